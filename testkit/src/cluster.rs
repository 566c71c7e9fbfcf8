//! A simulated multi-node cluster made by the real `rivet cluster up`
//! (issue 16 §5): one etcd, the underlay bridge namespace, N node
//! namespaces each running `rivet node up` with every node daemon as its
//! own process, pods wired by each node's real rivet-cni. The topology has
//! one implementation, the CLI's ([`rivet_cli::cluster`]); this fixture
//! drives it and reads what it records (cluster.json, node.json), and
//! `rivet cluster down` removes everything on drop, also on panic.
//!
//! Nodes are numbered from 1, as their names are (`<cluster>-n<i>`); the
//! address plan is [`rivet_cli::cluster::ClusterPlan`]'s.
//!
//! ```no_run
//! # async fn t() {
//! use rivet_testkit::cluster::{Cluster, ClusterOptions, Routing};
//!
//! let mut cluster = Cluster::start(ClusterOptions { routing: Routing::Vxlan, ..Default::default() })
//!     .await
//!     .unwrap();
//! let web = cluster.add_pod(1, "default", "web", &["app=web"]).await;
//! let client = cluster.add_pod(2, "default", "client", &["app=client"]).await;
//! cluster.wait_converged().await;
//! let _server = web.netns.tcp_echo_server(&[web.socket_v4(80)]).unwrap();
//! assert!(client.netns.tcp_echo(web.socket_v4(80), std::time::Duration::from_secs(2)).unwrap());
//! # }
//! ```
//!
//! Needs root, a bpffs at /sys/fs/bpf, the rivet users and etcd 3.6
//! (`cargo xtask install`) and the workspace binaries (`cargo build --bins`).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rivet_cli::cluster::{ClusterRecord, NodePlan, cluster_dir};
use rivet_cli::node::{DaemonPhase, NodeRecord};
use rivet_cli::pod::PodRecord;
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::netns::NetNs;
use rivet_proto::loader::v1 as ldpb;
use rivet_proto::loader::v1::load_balancer_service_client::LoadBalancerServiceClient;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;
use rivet_proto::loader::v1::node_routing_service_client::NodeRoutingServiceClient;

pub use rivet_cli::cluster::Routing;

/// How long [`Cluster::wait_converged`] waits by default.
pub const CONVERGE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a node daemon killed by [`Cluster::kill9`] may take to be
/// running again (the supervisor's first backoff is 200 ms; a shared
/// 2-core machine under a release link once took more than 30 s).
const RESTART_TIMEOUT: Duration = Duration::from_secs(60);

/// How often the fixture looks again at what it waits for.
const POLL: Duration = Duration::from_millis(50);

static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// `--timeout` of the policy commands, seconds: longer than the CLI's 5 s
/// default, which a node whose svc-identity is reconnecting to a restarted
/// etcd (5 s to dial, 5 s per request) can exceed on a loaded machine (seen
/// in the chaos run: "Cancelled: Timeout expired" right after an etcd
/// restart at load 17).
const POLICY_WAIT_SECONDS: &str = "30";

/// What [`Cluster::start`] builds.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Number of nodes (1 to 253).
    pub nodes: usize,
    /// Routing mode of every node.
    pub routing: Routing,
    /// svc-identity's `--lease-ttl-seconds` on every node: short for crash
    /// tests (a crashed node's keys go when its lease expires). `None`:
    /// the daemon's default.
    pub lease_ttl_seconds: Option<u64>,
    /// More `DAEMON=ARG` flags for every node (`rivet node up --daemon-arg`).
    pub daemon_args: Vec<String>,
    /// Time between SIGTERM and SIGKILL when a node stops a daemon.
    pub stop_grace_seconds: u64,
    /// Where `rivet` and the daemon binaries are; `None`: beside the
    /// running test ([`rivet_common::testing::workspace_binary`]).
    pub bin_dir: Option<PathBuf>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            nodes: 3,
            routing: Routing::Native,
            lease_ttl_seconds: None,
            daemon_args: Vec::new(),
            stop_grace_seconds: 5,
            bin_dir: None,
        }
    }
}

/// What went wrong making a cluster.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// Why.
        source: std::io::Error,
    },
    /// A `rivet` command failed.
    #[error("`{command}` failed ({status}):\n{output}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its stdout and stderr.
        output: String,
    },
    /// cluster.json is missing or unreadable after `up`.
    #[error("reading the cluster record in {dir}: {message}")]
    Record {
        /// The cluster dir.
        dir: PathBuf,
        /// Why.
        message: String,
    },
}

/// Whether a node runs, left, or crashed (as the fixture made it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    /// Its daemons run.
    Running,
    /// Stopped cleanly ([`Cluster::stop_node`]).
    Stopped,
    /// Killed with SIGKILL, supervisor included ([`Cluster::crash_node`]).
    Crashed,
}

/// One node of the cluster.
#[derive(Debug)]
pub struct ClusterNode {
    /// 1-based position.
    pub index: usize,
    /// Node name (also its namespace's).
    pub name: String,
    /// The node namespace (left alone on drop: `rivet cluster down`
    /// removes it).
    pub netns: NetNs,
    /// The node's state dir (node.json, pods, the daemons' dirs).
    pub state_dir: PathBuf,
    /// Its socket dir.
    pub socket_dir: PathBuf,
    /// Underlay IPv4 address (on `ul0`).
    pub underlay_v4: Ipv4Addr,
    /// Underlay IPv6 address (on `ul0`).
    pub underlay_v6: Ipv6Addr,
    /// Its pod CIDRs, IPv4 then IPv6.
    pub pod_cidrs: [String; 2],
    /// What the fixture did to it last.
    pub state: NodeState,
    rivet: PathBuf,
    cluster_state_dir: PathBuf,
}

impl ClusterNode {
    fn new(
        plan: &NodePlan,
        record: &ClusterRecord,
        rivet: &Path,
        cluster_state_dir: &Path,
    ) -> Result<Self, ClusterError> {
        let netns = NetNs::existing(&plan.name).map_err(|e| ClusterError::Record {
            dir: record.dir.clone(),
            message: format!("the namespace of node {}: {e}", plan.name),
        })?;
        Ok(Self {
            index: plan.index,
            name: plan.name.clone(),
            netns,
            state_dir: record.node_dir(&plan.name),
            socket_dir: record.socket_dir(&plan.name),
            underlay_v4: plan.underlay_v4,
            underlay_v6: plan.underlay_v6,
            pod_cidrs: [plan.pod_cidr_v4.clone(), plan.pod_cidr_v6.clone()],
            state: NodeState::Running,
            rivet: rivet.to_path_buf(),
            cluster_state_dir: cluster_state_dir.to_path_buf(),
        })
    }

    /// `rivet --state-dir <cluster state> --node <name> <args>`: any
    /// per-node command (`pod add`, `bpf ipcache`, `node list`, `status`).
    pub fn rivet(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.rivet);
        cmd.arg("--state-dir")
            .arg(&self.cluster_state_dir)
            .args(["--node", &self.name])
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    /// Runs `rivet --node <name> <args>`; its stdout, or a panic with its output.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.rivet(args).output().expect("running rivet");
        assert!(
            out.status.success(),
            "rivet --node {} {} failed ({}): {}",
            self.name,
            args.join(" "),
            out.status,
            shown(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// [`ok`](Self::ok) with `-o json`, parsed.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&all)).expect("rivet -o json prints JSON")
    }

    /// The node's node.json (`None` when it is stopped).
    pub fn record(&self) -> Option<NodeRecord> {
        NodeRecord::load(&self.state_dir).expect("node.json parses")
    }

    /// The socket of daemon `name`.
    pub fn socket(&self, daemon: &str) -> PathBuf {
        rivet_common::socket::socket_path(&self.socket_dir, daemon)
    }

    async fn channel(&self, daemon: &str) -> DaemonChannel {
        let socket = self.socket(daemon);
        connect_unix(&socket, &ClientOptions::default())
            .await
            .unwrap_or_else(|e| panic!("connecting to {} of node {}: {e}", socket.display(), self.name))
    }

    /// A client of the node's svc-loader.
    pub async fn loader(&self) -> LoaderServiceClient<DaemonChannel> {
        LoaderServiceClient::new(self.channel("svc-loader").await)
    }

    /// A client of the node's svc-loader LoadBalancerService.
    pub async fn load_balancer(&self) -> LoadBalancerServiceClient<DaemonChannel> {
        LoadBalancerServiceClient::new(self.channel("svc-loader").await)
    }

    /// The services the node's datapath holds (svc-loader
    /// LoadBalancerService.ListServices).
    pub async fn datapath_services(&self) -> Result<ldpb::ListServicesResponse, tonic::Status> {
        Ok(self
            .load_balancer()
            .await
            .list_services(ldpb::ListServicesRequest::default())
            .await?
            .into_inner())
    }

    /// A client of the node's svc-loader NodeRoutingService.
    pub async fn node_routing(&self) -> NodeRoutingServiceClient<DaemonChannel> {
        NodeRoutingServiceClient::new(self.channel("svc-loader").await)
    }

    /// Every entry of the node's datapath ipcache (svc-loader ListIpcache, all pages).
    pub async fn datapath_ipcache(&self) -> Result<Vec<ldpb::IpcacheEntry>, tonic::Status> {
        rivet_cli::bpf::list_ipcache(&mut self.loader().await).await
    }

    /// The peers the node's svc-loader holds (NodeRoutingService.ListNodes).
    pub async fn datapath_peers(&self) -> Result<ldpb::ListNodesResponse, tonic::Status> {
        Ok(self
            .node_routing()
            .await
            .list_nodes(ldpb::ListNodesRequest {})
            .await?
            .into_inner())
    }

    /// `ip <args>` in the node namespace; its stdout.
    pub fn ip(&self, args: &[&str]) -> String {
        self.netns
            .ip(args)
            .unwrap_or_else(|e| panic!("ip {} in node {}: {e}", args.join(" "), self.name))
    }
}

/// A pod made by `rivet --node <node> pod add` (deleted by `rivet cluster
/// down`, or [`Cluster::delete_pod`]).
#[derive(Debug)]
pub struct ClusterPod {
    /// The node it runs on (1-based).
    pub node: usize,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Its network namespace (probes, echo servers; left alone on drop).
    pub netns: NetNs,
    /// IPv4 address.
    pub ipv4: Ipv4Addr,
    /// IPv6 address.
    pub ipv6: Ipv6Addr,
    /// The container id its CNI calls named (svc-ipam's owner of its addresses).
    pub container_id: String,
}

impl ClusterPod {
    /// Its addresses, IPv4 first.
    pub fn addrs(&self) -> [IpAddr; 2] {
        [IpAddr::V4(self.ipv4), IpAddr::V6(self.ipv6)]
    }

    /// `ipv4:port`.
    pub fn socket_v4(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.ipv4, port))
    }

    /// `[ipv6]:port`.
    pub fn socket_v6(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.ipv6, port))
    }
}

/// A pod the cluster knows of: where it runs and its addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
struct KnownPod {
    node: usize,
    namespace: String,
    name: String,
    addrs: [IpAddr; 2],
}

/// A running cluster; `rivet cluster down` on drop.
#[derive(Debug)]
pub struct Cluster {
    /// Cluster name.
    pub name: String,
    /// Routing mode.
    pub routing: Routing,
    nodes: Vec<ClusterNode>,
    pods: Vec<KnownPod>,
    rivet: PathBuf,
    record: ClusterRecord,
    /// The `--state-dir` of every `rivet` call (the cluster lives in
    /// `clusters/<name>/` under it); removed last.
    state_dir: tempfile::TempDir,
    down: bool,
}

fn shown(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` on tokio's blocking pool; its output.
async fn output(mut cmd: Command) -> Result<Output, ClusterError> {
    let line = describe(&cmd);
    tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("the blocking pool runs the command")
        .map_err(|source| ClusterError::Io {
            context: format!("running `{line}`"),
            source,
        })
}

/// Runs `cmd`; its stdout, or [`ClusterError::Command`].
async fn checked(cmd: Command) -> Result<String, ClusterError> {
    let line = describe(&cmd);
    let out = output(cmd).await?;
    if !out.status.success() {
        return Err(ClusterError::Command {
            command: line,
            status: out.status,
            output: shown(&out),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Cluster {
    /// `rivet cluster up` with a name unique to this process, in a temp
    /// state dir the daemons' users can reach; returns once every node is up.
    pub async fn start(options: ClusterOptions) -> Result<Self, ClusterError> {
        let rivet = match &options.bin_dir {
            Some(dir) => dir.join("rivet"),
            None => rivet_common::testing::workspace_binary("rivet"),
        };
        let state_dir = tempfile::Builder::new()
            .prefix("rvc")
            .tempdir_in("/tmp")
            .map_err(|source| ClusterError::Io {
                context: "creating the cluster's state dir in /tmp".into(),
                source,
            })?;
        std::fs::set_permissions(state_dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).map_err(
            |source| ClusterError::Io {
                context: format!("making {} reachable", state_dir.path().display()),
                source,
            },
        )?;
        let name = format!(
            "rc{:x}x{:x}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );
        let mut cmd = Command::new(&rivet);
        cmd.arg("--state-dir")
            .arg(state_dir.path())
            .args(["cluster", "up", "--name", &name])
            .args(["--nodes", &options.nodes.to_string()])
            .args(["--routing", options.routing.as_str()])
            .args(["--stop-grace-seconds", &options.stop_grace_seconds.to_string()])
            .stdin(Stdio::null());
        if let Some(dir) = &options.bin_dir {
            cmd.arg("--bin-dir").arg(dir);
        }
        if let Some(ttl) = options.lease_ttl_seconds {
            cmd.args(["--daemon-arg", &format!("svc-identity=--lease-ttl-seconds={ttl}")]);
        }
        for arg in &options.daemon_args {
            cmd.args(["--daemon-arg", arg]);
        }
        // On failure `up` removed what it made.
        checked(cmd).await?;
        let dir = cluster_dir(state_dir.path(), &name);
        let record = ClusterRecord::load(&dir)
            .map_err(|e| ClusterError::Record {
                dir: dir.clone(),
                message: format!("{e:#}"),
            })?
            .ok_or_else(|| ClusterError::Record {
                dir: dir.clone(),
                message: "no cluster.json".into(),
            })?;
        let mut cluster = Self {
            name,
            routing: options.routing,
            nodes: Vec::new(),
            pods: Vec::new(),
            rivet,
            record,
            state_dir,
            down: false,
        };
        for plan in &cluster.record.plan.nodes {
            let node = ClusterNode::new(plan, &cluster.record, &cluster.rivet, cluster.state_dir.path())?;
            cluster.nodes.push(node);
        }
        Ok(cluster)
    }

    /// Node `i`, counted from 1 as the names are.
    pub fn node(&self, i: usize) -> &ClusterNode {
        assert!(
            (1..=self.nodes.len()).contains(&i),
            "nodes are numbered 1 to {} (node {i} asked for)",
            self.nodes.len()
        );
        &self.nodes[i - 1]
    }

    fn node_mut(&mut self, i: usize) -> &mut ClusterNode {
        assert!(
            (1..=self.nodes.len()).contains(&i),
            "nodes are numbered 1 to {}",
            self.nodes.len()
        );
        &mut self.nodes[i - 1]
    }

    /// Every node, in order.
    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// The shared etcd's client URL.
    pub fn etcd_endpoint(&self) -> String {
        self.record
            .etcd
            .as_ref()
            .expect("the cluster runs etcd")
            .endpoint
            .clone()
    }

    /// The cluster as recorded in cluster.json.
    pub fn record(&self) -> &ClusterRecord {
        &self.record
    }

    /// `rivet --state-dir <cluster state> <args>` (cluster-wide commands:
    /// `cluster status --name <name>`, ...).
    pub fn rivet(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.rivet);
        cmd.arg("--state-dir")
            .arg(self.state_dir.path())
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    async fn cluster_command(&self, args: &[&str]) -> String {
        let mut cmd = self.rivet(&["cluster"]);
        let (sub, rest) = args.split_first().expect("a cluster subcommand");
        cmd.arg(sub).args(["--name", &self.name]).args(rest);
        checked(cmd).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// `rivet --node <node> pod add <name> -n <namespace> -l <label>...`
    /// through the node's real rivet-cni; `labels` are `key=value`.
    /// Panics when the add fails ([`try_add_pod`](Self::try_add_pod) does not).
    pub async fn add_pod(&mut self, node: usize, namespace: &str, name: &str, labels: &[&str]) -> ClusterPod {
        self.try_add_pod(node, namespace, name, labels)
            .await
            .unwrap_or_else(|e| panic!("adding pod {namespace}/{name}: {e}"))
    }

    /// [`add_pod`](Self::add_pod), with a failed `rivet pod add` (a CNI
    /// error, e.g. while the kvstore is away) as `Err(its output)`.
    pub async fn try_add_pod(
        &mut self,
        node: usize,
        namespace: &str,
        name: &str,
        labels: &[&str],
    ) -> Result<ClusterPod, String> {
        let cmd = self.pod_add_command(node, namespace, name, labels);
        let stdout = checked(cmd).await.map_err(|e| e.to_string())?;
        Ok(self.pod_added(node, namespace, name, &stdout))
    }

    /// [`try_add_pod`](Self::try_add_pod) while daemon `daemon` of the same
    /// node is killed with SIGKILL as soon as the add started
    /// ([`kill9`](Self::kill9): returns once the daemon runs again and the
    /// add ended). The add may fail (a runtime would retry) or succeed.
    pub async fn try_add_pod_during_kill9(
        &mut self,
        node: usize,
        namespace: &str,
        name: &str,
        labels: &[&str],
        daemon: &str,
    ) -> Result<ClusterPod, String> {
        let cmd = self.pod_add_command(node, namespace, name, labels);
        let (added, ()) = tokio::join!(checked(cmd), self.kill9(node, daemon));
        let stdout = added.map_err(|e| e.to_string())?;
        Ok(self.pod_added(node, namespace, name, &stdout))
    }

    fn pod_add_command(&self, node: usize, namespace: &str, name: &str, labels: &[&str]) -> Command {
        let mut args = vec!["pod", "add", name, "-n", namespace, "-o", "json"];
        for label in labels {
            args.extend(["--label", label]);
        }
        self.node(node).rivet(&args)
    }

    /// Records the pod `rivet pod add -o json` printed as `stdout`.
    fn pod_added(&mut self, node: usize, namespace: &str, name: &str, stdout: &str) -> ClusterPod {
        let record: PodRecord = serde_json::from_str(stdout)
            .unwrap_or_else(|e| panic!("`rivet pod add -o json` prints the pod record ({e}): {stdout}"));
        let addresses: Vec<IpAddr> = record
            .addresses()
            .iter()
            .map(|a| a.parse().unwrap_or_else(|e| panic!("pod address {a}: {e}")))
            .collect();
        let ipv4 = addresses
            .iter()
            .find_map(|a| match a {
                IpAddr::V4(v4) => Some(*v4),
                IpAddr::V6(_) => None,
            })
            .unwrap_or_else(|| panic!("pod {namespace}/{name} has an IPv4 address: {addresses:?}"));
        let ipv6 = addresses
            .iter()
            .find_map(|a| match a {
                IpAddr::V6(v6) => Some(*v6),
                IpAddr::V4(_) => None,
            })
            .unwrap_or_else(|| panic!("pod {namespace}/{name} has an IPv6 address: {addresses:?}"));
        let netns = NetNs::existing(&record.netns).unwrap_or_else(|e| panic!("the pod's namespace: {e}"));
        self.pods.push(KnownPod {
            node,
            namespace: namespace.into(),
            name: name.into(),
            addrs: [IpAddr::V4(ipv4), IpAddr::V6(ipv6)],
        });
        ClusterPod {
            node,
            namespace: namespace.into(),
            name: name.into(),
            netns,
            ipv4,
            ipv6,
            container_id: record.container_id.clone(),
        }
    }

    /// A client host outside the cluster on its underlay bridge (a
    /// NodePort client, [`crate::loader::ExternalClient::on_bridge`]);
    /// dropping it removes it.
    pub fn add_external_client(&self) -> crate::loader::ExternalClient {
        let underlay = NetNs::existing(&self.record.plan.underlay_netns).expect("the underlay namespace exists");
        crate::loader::ExternalClient::on_bridge(&underlay, rivet_cli::cluster::BRIDGE)
            .expect("a client on the underlay bridge")
    }

    /// `rivet --node <node> pod del`: CNI DEL, then its namespace.
    pub async fn delete_pod(&mut self, pod: ClusterPod) {
        self.try_delete_pod(&pod)
            .await
            .unwrap_or_else(|e| panic!("deleting pod {}/{}: {e}", pod.namespace, pod.name));
    }

    /// [`delete_pod`](Self::delete_pod), with a failed `rivet pod del` (a
    /// DEL error; the pod stays, for a retry) as `Err(its output)`.
    pub async fn try_delete_pod(&mut self, pod: &ClusterPod) -> Result<(), String> {
        let cmd = self
            .node(pod.node)
            .rivet(&["pod", "del", &pod.name, "-n", &pod.namespace]);
        checked(cmd).await.map_err(|e| e.to_string())?;
        self.pods
            .retain(|p| !(p.node == pod.node && p.namespace == pod.namespace && p.name == pod.name));
        Ok(())
    }

    /// Applies policy documents (YAML) on every node and waits until each
    /// node's endpoints realised them (`rivet cluster policy apply --wait`).
    pub async fn apply_policy(&self, yaml: &str) {
        let file = tempfile::NamedTempFile::new_in(self.state_dir.path()).expect("a temp file for the policy");
        std::fs::write(file.path(), yaml).expect("writing the policy");
        let path = file.path().display().to_string();
        self.cluster_command(&[
            "policy",
            "apply",
            "-f",
            &path,
            "--wait",
            "--timeout",
            POLICY_WAIT_SECONDS,
        ])
        .await;
    }

    /// Deletes a policy (`kind/namespace/name`, or `namespace/name` for a
    /// NetworkPolicy) on every node, waiting until it is realised.
    pub async fn delete_policy(&self, key: &str) {
        self.cluster_command(&["policy", "delete", key, "--wait", "--timeout", POLICY_WAIT_SECONDS])
            .await;
    }

    /// Applies Service and EndpointSlice documents (multi-document YAML)
    /// on every node and waits until each node's svc-loader holds them
    /// (`rivet cluster service apply -f <file> --wait`: the first node
    /// allocates what the documents leave open, the others get its result).
    pub async fn apply_service(&self, yaml: &str) {
        let file = tempfile::NamedTempFile::new_in(self.state_dir.path()).expect("a temp file for the service");
        std::fs::write(file.path(), yaml).expect("writing the service");
        let path = file.path().display().to_string();
        // --timeout bounds each document's wait; the CLI's 5 s default
        // is what a loaded machine meets first.
        self.cluster_command(&["service", "apply", "-f", &path, "--wait", "--timeout", "60"])
            .await;
    }

    /// Waits until every running node's datapath holds the services of
    /// `cluster_ip` (one per port and family) and `ok` holds for each node's
    /// list of them; [`CONVERGE_TIMEOUT`] at most. Returns the lists, by node.
    pub async fn wait_datapath_services(
        &self,
        cluster_ip: IpAddr,
        ok: impl Fn(&[ldpb::LbServiceStatus]) -> bool,
    ) -> Vec<Vec<ldpb::LbServiceStatus>> {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let mut all = Vec::new();
            let mut missing = Vec::new();
            for node in self.nodes.iter().filter(|n| n.state == NodeState::Running) {
                let services: Vec<ldpb::LbServiceStatus> = match node.datapath_services().await {
                    Ok(listed) => listed
                        .services
                        .into_iter()
                        .filter(|s| s.service.as_ref().is_some_and(|s| serves(s, cluster_ip)))
                        .collect(),
                    Err(e) => {
                        missing.push(format!("{}: {e}", node.name));
                        continue;
                    }
                };
                if !ok(&services) {
                    missing.push(format!("{}: {services:?}", node.name));
                }
                all.push(services);
            }
            if missing.is_empty() {
                return all;
            }
            assert!(
                Instant::now() < deadline,
                "the nodes' datapaths did not hold the services of {cluster_ip} as wanted within \
                 {CONVERGE_TIMEOUT:?}:\n  {}",
                missing.join("\n  ")
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Sets namespace `namespace`'s labels (`key=value`) on every node.
    pub async fn label_namespace(&self, namespace: &str, labels: &[&str]) {
        let mut args = vec!["namespace", "label", namespace];
        args.extend(labels);
        self.cluster_command(&args).await;
    }

    /// SIGKILL to daemon `daemon` of node `node`; returns once its
    /// supervisor runs it again (a new pid, answering on its socket).
    pub async fn kill9(&self, node: usize, daemon: &str) {
        let n = self.node(node);
        let before = n.record().unwrap_or_else(|| panic!("node {} runs", n.name));
        let status = before
            .daemon(daemon)
            .unwrap_or_else(|| panic!("node {} runs no {daemon}", n.name))
            .clone();
        let pid = status
            .pid
            .unwrap_or_else(|| panic!("{daemon} of node {} has a pid", n.name));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap_or_else(|e| panic!("SIGKILL to {daemon} (pid {pid}): {e}"));
        let deadline = Instant::now() + RESTART_TIMEOUT;
        loop {
            let now = n.record().and_then(|r| r.daemon(daemon).cloned());
            if let Some(d) = &now
                && d.phase == DaemonPhase::Running
                && d.pid.is_some_and(|p| p != pid)
                && d.restarts > status.restarts
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{daemon} of node {} was not running again {RESTART_TIMEOUT:?} after kill -9: {now:?}",
                n.name
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Crashes the cluster's etcd (SIGKILL) and starts it again on the same
    /// ports and data (`rivet cluster restart-etcd`); returns once it is
    /// healthy. Its new pid is in [`record`](Self::record) afterwards.
    pub async fn restart_etcd(&mut self) -> Result<(), ClusterError> {
        let cmd = self.rivet(&["cluster", "restart-etcd", "--name", &self.name]);
        checked(cmd).await?;
        let dir = self.record.dir.clone();
        self.record = ClusterRecord::load(&dir)
            .map_err(|e| ClusterError::Record {
                dir: dir.clone(),
                message: format!("{e:#}"),
            })?
            .ok_or_else(|| ClusterError::Record {
                dir,
                message: "no cluster.json after restart-etcd".into(),
            })?;
        Ok(())
    }

    /// Stops node `i` cleanly (`rivet cluster stop-node`): its pods are
    /// deleted, it removes its key and leaves the cluster at once.
    pub async fn stop_node(&mut self, i: usize) {
        let name = self.node(i).name.clone();
        self.cluster_command(&["stop-node", &name]).await;
        self.node_mut(i).state = NodeState::Stopped;
        self.pods.retain(|p| p.node != i);
    }

    /// Crashes node `i`: SIGKILL to its supervisor, then to every daemon;
    /// returns once all are gone. Its pods, pins and routes stay (a crash
    /// cleans nothing); peers forget it when its lease expires.
    pub async fn crash_node(&mut self, i: usize) {
        let n = self.node(i);
        let record = n.record().unwrap_or_else(|| panic!("node {} runs", n.name));
        let pids: Vec<u32> = std::iter::once(record.supervisor_pid)
            .chain(record.daemons.iter().filter_map(|d| d.pid))
            .collect();
        for pid in &pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let deadline = Instant::now() + RESTART_TIMEOUT;
        while pids.iter().any(|p| alive(*p)) {
            assert!(
                Instant::now() < deadline,
                "node {} processes {pids:?} still run after SIGKILL",
                n.name
            );
            tokio::time::sleep(POLL).await;
        }
        self.node_mut(i).state = NodeState::Crashed;
        self.pods.retain(|p| p.node != i);
    }

    /// Starts node `i` again (`rivet cluster start-node`, which first
    /// cleans up what a crash left: pods, pins, sockets).
    pub async fn start_node(&mut self, i: usize) {
        let name = self.node(i).name.clone();
        self.cluster_command(&["start-node", &name]).await;
        self.node_mut(i).state = NodeState::Running;
    }

    /// Waits until every running node's svc-loader holds every other
    /// running node as a peer (NodeRoutingService.ListNodes) and every pod
    /// of the other running nodes in its ipcache (VXLAN: with that node's
    /// underlay IPv4 as tunnel endpoint), and neither any node that is not
    /// running nor its pods. [`CONVERGE_TIMEOUT`] at most.
    pub async fn wait_converged(&self) {
        self.wait_converged_within(CONVERGE_TIMEOUT).await;
    }

    /// [`wait_converged`](Self::wait_converged) with its own timeout;
    /// returns how long it took.
    pub async fn wait_converged_within(&self, timeout: Duration) -> Duration {
        let started = Instant::now();
        loop {
            let missing = self.not_converged().await;
            if missing.is_empty() {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < timeout,
                "cluster {} did not converge within {timeout:?}:\n  {}",
                self.name,
                missing.join("\n  ")
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// What keeps the cluster from being converged, one line each.
    pub async fn not_converged(&self) -> Vec<String> {
        let mut missing = Vec::new();
        let running: Vec<&ClusterNode> = self.nodes.iter().filter(|n| n.state == NodeState::Running).collect();
        let gone: Vec<&ClusterNode> = self.nodes.iter().filter(|n| n.state != NodeState::Running).collect();
        for node in &running {
            match node.datapath_peers().await {
                Ok(listing) => {
                    let held: BTreeSet<&str> = listing.nodes.iter().map(|p| p.name.as_str()).collect();
                    for peer in running.iter().filter(|p| p.index != node.index) {
                        if !held.contains(peer.name.as_str()) {
                            missing.push(format!("{}: svc-loader lacks peer {}", node.name, peer.name));
                        }
                    }
                    for peer in &gone {
                        if held.contains(peer.name.as_str()) {
                            missing.push(format!(
                                "{}: svc-loader still holds peer {} ({:?})",
                                node.name, peer.name, peer.state
                            ));
                        }
                    }
                }
                Err(e) => missing.push(format!("{}: NodeRoutingService.ListNodes: {e}", node.name)),
            }
            let ipcache = match node.datapath_ipcache().await {
                Ok(entries) => entries,
                Err(e) => {
                    missing.push(format!("{}: ListIpcache: {e}", node.name));
                    continue;
                }
            };
            let held: Vec<(IpAddr, u8, &[u8])> = ipcache
                .iter()
                .filter_map(|e| {
                    let prefix = e.prefix.as_ref()?;
                    let net = rivet_proto::net::prefix_from_proto(prefix).ok()?;
                    Some((net.addr(), net.prefix_len(), e.tunnel_endpoint.as_slice()))
                })
                .collect();
            for pod in self.pods.iter().filter(|p| p.node != node.index) {
                let host = self.node(pod.node);
                let live = host.state == NodeState::Running;
                for addr in pod.addrs {
                    let full = if addr.is_ipv4() { 32 } else { 128 };
                    let entry = held.iter().find(|(a, len, _)| *a == addr && *len == full);
                    match (entry, live) {
                        (None, true) => missing.push(format!(
                            "{}: ipcache lacks pod {}/{} {addr} of {}",
                            node.name, pod.namespace, pod.name, host.name
                        )),
                        (Some((_, _, tunnel)), true)
                            if self.routing == Routing::Vxlan && *tunnel != host.underlay_v4.octets().as_slice() =>
                        {
                            missing.push(format!(
                                "{}: ipcache entry of {addr} tunnels to {tunnel:?}, not {} ({})",
                                node.name, host.underlay_v4, host.name
                            ))
                        }
                        _ => {}
                    }
                }
            }
        }
        missing
    }

    /// `rivet cluster down` now (drop does it otherwise); panics when
    /// something could not be removed.
    pub async fn down(mut self) {
        self.down = true;
        let out = self.rivet(&["cluster", "down", "--name", &self.name]);
        checked(out).await.unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Whether `service` has a ClusterIP frontend at `address`.
fn serves(service: &ldpb::LbService, address: IpAddr) -> bool {
    let bytes = match address {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    service
        .frontends
        .iter()
        .any(|f| f.kind == ldpb::FrontendKind::ClusterIp as i32 && f.address == bytes)
}

/// Whether `pid` runs (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.down {
            return;
        }
        let out = self.rivet(&["cluster", "down", "--name", &self.name]).output();
        match out {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "rivet cluster down --name {} failed ({}): {}",
                self.name,
                out.status,
                shown(&out)
            ),
            Err(e) => eprintln!("running rivet cluster down --name {}: {e}", self.name),
        }
    }
}
