//! `rivet cluster up|down|status|start-node|stop-node|restart-etcd|policy|service|namespace`: a
//! multi-node cluster simulated on one machine (DESIGN.md §8, issue 16 §5),
//! for demos, tests and benchmarks. Nothing touches the machine's real
//! interfaces.
//!
//! `rivet cluster up --nodes N [--routing native|vxlan] [--name C]` makes:
//! - one etcd v3.6 (`cargo xtask install` builds it; `--etcd-binary`) on
//!   127.0.0.1 with free ports, in its own session, its data under the
//!   cluster dir `<state-dir>/clusters/<C>/etcd/`;
//! - the underlay: namespace `<C>-ul` with the bridge `ul`;
//! - per node `i` (1-based): namespace `<C>-n<i>` (forwarding on, IPv6 DAD
//!   off) with veth `ul0` (MTU 1500, 198.19.254.`i`/24 and
//!   2001:2:0:fe::`i`/64) whose peer `n<i>` is a port of the bridge, and
//!   `rivet node up --detach` in it: node name `<C>-n<i>`, pool
//!   `default=198.18.<i>.0/24,2001:2:0:<i>::/64`, the shared etcd,
//!   `--routing <mode> --underlay-interface ul0 --cluster-name <C>` (so
//!   the pod MTU is 1450 with VXLAN), and its own state,
//!   socket, log and CNI dirs under `<cluster-dir>/<node>/` (several nodes
//!   on one machine never share a conflist or a socket).
//!
//! `<cluster-dir>/cluster.json` ([`ClusterRecord`]) records each piece
//! before it is made, so `rivet cluster down` removes everything — the
//! nodes (`rivet node down` each: pods, daemons, pins), etcd, the
//! namespaces and the cluster dir — also after a crashed or half-done
//! `up`. An `up` that fails tears down what it made.
//!
//! Every per-node command takes the global `--node <name>`: `rivet --node
//! rivet-n2 pod add web` wires a pod on node 2 through its real rivet-cni,
//! `rivet --node rivet-n2 bpf ipcache` reads its datapath (the node is
//! looked up in the clusters of `--state-dir`). Without Kubernetes,
//! policies and namespace labels live in each node's svc-endpoint, so
//! `rivet cluster policy apply -f FILE` (and `delete`, `list`) and
//! `rivet cluster namespace label ...` run the same command on every node;
//! so does `rivet cluster service ...`, whose `apply` gives every node the
//! first node's clusterIPs and node ports for a Service that names none.
//!
//! `rivet cluster restart-etcd` crashes etcd (SIGKILL) and starts it again
//! on the same ports and data.
//!
//! `rivet cluster stop-node NODE` stops one node cleanly (it leaves the
//! cluster at once; its namespace and underlay link stay) and
//! `rivet cluster start-node NODE` starts it again with the same flags
//! (after cleaning up what a crashed node left).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Args, Subcommand};
use rivet_common::state_file::StateFile;
use serde::{Deserialize, Serialize};

use crate::node::{NodePhase, NodeRecord};
use crate::{Context, namespace, policy, service};

mod etcd;
mod plan;
mod topology;
mod up;

pub use etcd::EtcdRecord;
pub use plan::{
    BRIDGE, ClusterPlan, MAX_NAME, MAX_NODES, NodePlan, POOL, Routing, UNDERLAY_INTERFACE, UNDERLAY_MTU, check_name,
};
pub use up::{ClusterStatus, NodeStatus, cluster_status};

/// The cluster record in the cluster dir.
pub const CLUSTER_FILE: &str = "cluster.json";

/// Directory of the clusters under the state dir.
pub const CLUSTERS_DIR: &str = "clusters";

/// Name of a cluster made without `--name`.
pub const DEFAULT_NAME: &str = "rivet";

/// Schema version of cluster.json.
const CLUSTER_SCHEMA: u32 = 1;

/// `rivet cluster ...`
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Start a cluster: etcd, the underlay, N node namespaces, a node in each.
    Up(UpArgs),
    /// Stop every node and etcd, remove the namespaces and the cluster dir
    /// (also what a crashed `up` left).
    Down {
        /// Cluster name.
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
    },
    /// The cluster's etcd and nodes with their daemons. Exit status 1 when
    /// etcd is not healthy, a node crashed or a running node's daemon is
    /// not running (a node stopped with `stop-node` is fine).
    Status {
        /// Cluster name.
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
    },
    /// Stop one node cleanly (`rivet node down`): it leaves the cluster.
    StopNode {
        /// Node name (`<cluster>-n<i>`).
        node: String,
        /// Cluster name.
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
    },
    /// Start one node again with the flags of `up` (cleaning up first what
    /// a crashed node left).
    StartNode {
        /// Node name (`<cluster>-n<i>`).
        node: String,
        /// Cluster name.
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
    },
    /// Crash the cluster's etcd (SIGKILL) and start it again on the same
    /// ports and data; returns once it is healthy. The nodes' clients
    /// reconnect on their own.
    RestartEtcd {
        /// Cluster name.
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
        /// The etcd v3.6 binary; default: the one it ran, else the one
        /// `cargo xtask install` built.
        #[arg(long, value_name = "PATH")]
        etcd_binary: Option<PathBuf>,
    },
    /// `rivet policy ...` on every node, in order (policies are per node
    /// without Kubernetes).
    Policy {
        /// Cluster name.
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
        #[command(subcommand)]
        command: policy::PolicyCommand,
    },
    /// `rivet service ...` on every node, in order (Services are per node
    /// without Kubernetes). `apply` applies on the first node, then the
    /// Services as that node stored them (with its clusterIPs and node
    /// ports) and the other documents as given on every other node, so a
    /// Service has the same addresses everywhere.
    Service {
        /// Cluster name.
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
        #[command(subcommand)]
        command: service::ServiceCommand,
    },
    /// `rivet namespace ...` on every node, in order.
    Namespace {
        /// Cluster name.
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
        #[command(subcommand)]
        command: namespace::NamespaceCommand,
    },
}

/// `rivet cluster up`.
#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Cluster name: prefixes the node and namespace names.
    #[arg(long, default_value = DEFAULT_NAME)]
    pub name: String,
    /// Number of nodes.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// How pod traffic crosses nodes.
    #[arg(long, value_enum, default_value_t = Routing::Native)]
    pub routing: Routing,
    /// The etcd v3.6 binary; default: the one `cargo xtask install` built.
    #[arg(long, value_name = "PATH")]
    pub etcd_binary: Option<PathBuf>,
    /// Where the daemon binaries and rivet-cni are; default: the directory
    /// of this `rivet`.
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// An extra flag for one daemon of every node, DAEMON=ARG (`rivet node
    /// up --daemon-arg`); repeat for several.
    #[arg(long = "daemon-arg", value_name = "DAEMON=ARG")]
    pub daemon_args: Vec<String>,
    /// Time between SIGTERM and SIGKILL when stopping a daemon, seconds.
    #[arg(long, default_value_t = 10)]
    pub stop_grace_seconds: u64,
    /// Every node's --service-cidr (the same on all, so a Service's given
    /// clusterIP is valid everywhere); repeat for both families.
    #[arg(long = "service-cidr", value_name = "CIDR",
          default_values_t = [crate::node::DEFAULT_SERVICE_CIDR4.parse::<ipnet::IpNet>().expect("a CIDR"),
                              crate::node::DEFAULT_SERVICE_CIDR6.parse::<ipnet::IpNet>().expect("a CIDR")])]
    pub service_cidrs: Vec<ipnet::IpNet>,
}

/// Lifecycle of a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClusterPhase {
    /// `up` is making it.
    Starting,
    /// Every node came up.
    Running,
    /// `down` is removing it.
    Stopping,
}

/// `<state-dir>/clusters/<name>/cluster.json`: what the cluster is made of,
/// each piece recorded before it is made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRecord {
    /// Names and addresses.
    pub plan: ClusterPlan,
    /// Lifecycle phase.
    pub phase: ClusterPhase,
    /// The cluster dir.
    pub dir: PathBuf,
    /// Pid of the `rivet cluster up` that made it.
    pub up_pid: u32,
    /// The etcd, once started.
    pub etcd: Option<EtcdRecord>,
    /// Namespaces (the underlay's, then the nodes') to delete.
    pub namespaces: Vec<String>,
    /// The flags of every node's `rivet node up` after the per-node ones
    /// (`start-node` reuses them).
    pub node_up_args: Vec<String>,
    /// Where the binaries are.
    pub bin_dir: PathBuf,
    /// Creation, Unix nanoseconds.
    pub created_unix_nanos: i64,
}

impl ClusterRecord {
    fn file(dir: &Path) -> StateFile<Self> {
        StateFile::new(dir.join(CLUSTER_FILE), "cluster", CLUSTER_SCHEMA)
    }

    /// The cluster recorded in `dir`, if any.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        Ok(Self::file(dir).load()?)
    }

    /// The cluster named `name` under `state_dir`.
    pub fn find(state_dir: &Path, name: &str) -> Result<Self> {
        check_name(name)?;
        let dir = cluster_dir(state_dir, name);
        Self::load(&dir)?.ok_or_else(|| {
            anyhow!(
                "no cluster `{name}` in {} (start one with `rivet --state-dir {} cluster up --name {name}`)",
                dir.display(),
                state_dir.display()
            )
        })
    }

    /// Writes cluster.json (atomically).
    pub fn store(&self) -> Result<()> {
        Ok(Self::file(&self.dir).store(self)?)
    }

    /// The node named `name`.
    pub fn node(&self, name: &str) -> Result<&NodePlan> {
        self.plan.node(name).ok_or_else(|| {
            anyhow!(
                "cluster {} has no node `{name}` (its nodes: {})",
                self.plan.name,
                self.plan
                    .nodes
                    .iter()
                    .map(|n| n.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }

    /// The state dir of node `name` (also of its pods and node.json).
    pub fn node_dir(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The socket dir of node `name`.
    pub fn socket_dir(&self, name: &str) -> PathBuf {
        self.node_dir(name).join("sockets")
    }

    /// The running node `name`, from its node.json.
    pub fn node_record(&self, name: &str) -> Result<Option<NodeRecord>> {
        NodeRecord::load(&self.node_dir(name))
    }
}

/// `<state-dir>/clusters/<name>`.
pub fn cluster_dir(state_dir: &Path, name: &str) -> PathBuf {
    state_dir.join(CLUSTERS_DIR).join(name)
}

/// The state dir of node `node` of any cluster under `state_dir` (for the
/// global `--node`).
pub fn find_node_dir(state_dir: &Path, node: &str) -> Result<PathBuf> {
    let dir = state_dir.join(CLUSTERS_DIR);
    let entries: Vec<_> = match std::fs::read_dir(&dir) {
        Ok(e) => e.flatten().collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    for entry in entries {
        if let Ok(Some(cluster)) = ClusterRecord::load(&entry.path())
            && cluster.plan.node(node).is_some()
        {
            return Ok(cluster.node_dir(node));
        }
    }
    bail!(
        "no cluster under {} has a node `{node}` (see `rivet --state-dir {} cluster status`)",
        dir.display(),
        state_dir.display()
    )
}

/// Runs `rivet cluster ...`.
pub async fn run(ctx: &Context, state_dir: &Path, command: ClusterCommand) -> Result<bool> {
    match command {
        ClusterCommand::Up(args) => up::up(ctx, state_dir, &args).await,
        ClusterCommand::Down { name } => {
            check_name(&name)?;
            up::down(&cluster_dir(state_dir, &name)).await
        }
        ClusterCommand::Status { name } => {
            let cluster = ClusterRecord::find(state_dir, &name)?;
            let status = cluster_status(&cluster);
            ctx.print(&status, || status.render());
            Ok(status.healthy())
        }
        ClusterCommand::StopNode { node, name } => {
            let cluster = ClusterRecord::find(state_dir, &name)?;
            cluster.node(&node)?;
            up::stop_node(&cluster, &node).await
        }
        ClusterCommand::StartNode { node, name } => {
            let cluster = ClusterRecord::find(state_dir, &name)?;
            let plan = cluster.node(&node)?.clone();
            up::start_node(&cluster, &plan).await
        }
        ClusterCommand::RestartEtcd { name, etcd_binary } => {
            let cluster = ClusterRecord::find(state_dir, &name)?;
            let restarted = tokio::task::spawn_blocking(move || up::restart_etcd(cluster, etcd_binary))
                .await
                .context("restarting etcd on the blocking pool")??;
            println!("etcd {} restarted (pid {})", restarted.endpoint, restarted.pid);
            Ok(true)
        }
        ClusterCommand::Policy { name, command } => {
            let cluster = ClusterRecord::find(state_dir, &name)?;
            // Standard input can be read once: every node gets a copy.
            let stdin_copy = cluster.dir.join("policy-stdin.yaml");
            let command = match command {
                policy::PolicyCommand::Apply { file, wait } if file == "-" => {
                    let mut text = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut text).context("reading standard input")?;
                    std::fs::write(&stdin_copy, text).with_context(|| format!("writing {}", stdin_copy.display()))?;
                    policy::PolicyCommand::Apply {
                        file: stdin_copy.display().to_string(),
                        wait,
                    }
                }
                other => other,
            };
            let mut ok = true;
            for node in &cluster.plan.nodes {
                let node_ctx = node_context(ctx, &cluster, &node.name)?;
                if ctx.output == crate::Output::Table {
                    println!("node {}:", node.name);
                }
                let done = policy::run(&node_ctx, command.clone()).await;
                match done {
                    Ok(done) => ok &= done,
                    Err(e) => {
                        let _ = std::fs::remove_file(&stdin_copy);
                        return Err(anyhow!(e).context(format!("node {}", node.name)));
                    }
                }
            }
            let _ = std::fs::remove_file(&stdin_copy);
            Ok(ok)
        }
        ClusterCommand::Service { name, command } => {
            let cluster = ClusterRecord::find(state_dir, &name)?;
            apply_service_everywhere(ctx, &cluster, command).await
        }
        ClusterCommand::Namespace { name, command } => {
            let cluster = ClusterRecord::find(state_dir, &name)?;
            for node in &cluster.plan.nodes {
                let node_ctx = node_context(ctx, &cluster, &node.name)?;
                if ctx.output == crate::Output::Table {
                    println!("node {}:", node.name);
                }
                namespace::run(&node_ctx, command.clone())
                    .await
                    .map_err(|e| anyhow!(e).context(format!("node {}", node.name)))?;
            }
            Ok(true)
        }
    }
}

/// `rivet cluster service ...`: `apply` on the first node, then what it
/// stored on the others; every other command on each node in turn.
async fn apply_service_everywhere(
    ctx: &Context,
    cluster: &ClusterRecord,
    command: service::ServiceCommand,
) -> Result<bool> {
    let heading = |node: &str| {
        if ctx.output == crate::Output::Table {
            println!("node {node}:");
        }
    };
    let service::ServiceCommand::Apply { file, wait } = command else {
        let mut ok = true;
        for node in &cluster.plan.nodes {
            let node_ctx = node_context(ctx, cluster, &node.name)?;
            heading(&node.name);
            ok &= service::run(&node_ctx, command.clone())
                .await
                .map_err(|e| anyhow!(e).context(format!("node {}", node.name)))?;
        }
        return Ok(ok);
    };
    // Read once: standard input cannot be read per node.
    let documents = service::read_documents(&file)?;
    let Some((first, others)) = cluster.plan.nodes.split_first() else {
        bail!("cluster {} has no node", cluster.plan.name);
    };
    let first_ctx = node_context(ctx, cluster, &first.name)?;
    heading(&first.name);
    let view = service::apply(&first_ctx, documents.clone(), wait)
        .await
        .map_err(|e| anyhow!(e).context(format!("node {}", first.name)))?;
    if !service::print_apply(ctx, &view) {
        return Ok(false);
    }
    // The Services as the first node stored them (its allocations), the
    // slices as given.
    let mut stored = Vec::new();
    for applied in view.applied.iter().filter(|a| a.kind == "Service") {
        let name: service::ServiceName = applied.name.parse().map_err(|e: String| anyhow!(e))?;
        let documents = service::stored_documents(&first_ctx, &name)
            .await
            .map_err(|e| anyhow!(e).context(format!("reading {} back from node {}", applied.name, first.name)))?;
        let service_document = documents
            .into_iter()
            .next()
            .ok_or_else(|| anyhow!("node {} returned no document for {}", first.name, applied.name))?;
        stored.push(rivet_policy::documents::Document {
            number: applied.document,
            location: rivet_policy::documents::Location::Item(applied.document),
            text: service_document,
        });
    }
    let stored_numbers: Vec<usize> = stored.iter().map(|d| d.number).collect();
    stored.extend(documents.into_iter().filter(|d| !stored_numbers.contains(&d.number)));
    let mut ok = true;
    for node in others {
        let node_ctx = node_context(ctx, cluster, &node.name)?;
        heading(&node.name);
        let view = service::apply(&node_ctx, stored.clone(), wait)
            .await
            .map_err(|e| anyhow!(e).context(format!("node {}", node.name)))?;
        ok &= service::print_apply(ctx, &view);
    }
    Ok(ok)
}

/// `ctx` pointed at the sockets of node `name`, which must be running.
fn node_context(ctx: &Context, cluster: &ClusterRecord, name: &str) -> Result<Context> {
    let record = cluster.node_record(name)?;
    match record {
        Some(r) if r.phase == NodePhase::Running => Ok(Context {
            socket_dir: r.socket_dir,
            ..ctx.clone()
        }),
        _ => bail!(
            "node {name} of cluster {} is not running (see `rivet cluster status --name {}`)",
            cluster.plan.name,
            cluster.plan.name
        ),
    }
}

/// How long `down` waits for each node's supervisor.
const NODE_DOWN_TIMEOUT: Duration = Duration::from_secs(120);
