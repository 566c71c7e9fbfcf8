//! `rivet`: flags and dispatch; the commands live in the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use rivet_cli::node::NodeRecord;
use rivet_cli::{
    Context, Output, bpf, cluster, endpoint, identity, ipam, namespace, node, pod, policy, service, status,
};

/// Default `--state-dir` (the daemons' default too).
const DEFAULT_STATE_DIR: &str = "/var/run/rivet";

/// Default `--socket-dir` (the daemons' default too).
const DEFAULT_SOCKET_DIR: &str = "/var/run/rivet/sockets";

/// Inspect and drive a Rivet node.
#[derive(Debug, Parser)]
#[command(name = "rivet", version, about)]
struct Cli {
    /// Directory of the daemon sockets [default: the socket dir of the node
    /// recorded in the state dir, else /var/run/rivet/sockets].
    #[arg(long, global = true, env = "RIVET_SOCKET_DIR")]
    socket_dir: Option<PathBuf>,
    /// The node's state dir: the daemons' state, node.json and the pod records.
    #[arg(long, global = true, env = "RIVET_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Act on this node of a cluster of `rivet cluster up` (its state dir
    /// under `<state-dir>/clusters/`), e.g. `rivet --node rivet-n2 pod add web`.
    #[arg(long, global = true, env = "RIVET_NODE", value_name = "NODE")]
    node: Option<String>,
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// Deadline for reaching a daemon and for each call, in seconds.
    #[arg(long, global = true, default_value_t = 5.0)]
    timeout: f64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every daemon of the node: running, health, boot id, version; svc-identity's store, svc-endpoint's restore, endpoints, policy and links; the node's health.
    ///
    /// The node is as healthy as its worst daemon: "unhealthy" when a daemon's
    /// socket exists but it does not answer or its status cannot be read;
    /// "degraded" when every daemon answers but svc-identity cannot reach the
    /// kvstore (pods are still served from local state; changes are published
    /// when it is back); else "healthy". A daemon without a socket is "not
    /// running" and does not change the health. Every problem is printed in
    /// full under "node health" (`-o json`: each daemon's `health` and
    /// `problems`).
    ///
    /// Exit status: 0 healthy, 1 unhealthy (or the command failed), 2 usage
    /// error, 3 degraded.
    Status,
    /// Address pools (svc-ipam).
    #[command(subcommand)]
    Ipam(ipam::IpamCommand),
    /// Security identities (svc-identity).
    #[command(subcommand)]
    Identity(identity::IdentityCommand),
    /// IP → identity entries (svc-identity).
    #[command(subcommand)]
    Ipcache(identity::IpcacheCommand),
    /// Endpoints: one per pod interface (svc-endpoint).
    #[command(subcommand)]
    Endpoint(endpoint::EndpointCommand),
    /// Network policies (svc-endpoint).
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// Services and EndpointSlices without Kubernetes (svc-endpoint's service catalog).
    #[command(subcommand)]
    Service(service::ServiceCommand),
    /// Namespace labels (svc-endpoint).
    #[command(subcommand)]
    Namespace(namespace::NamespaceCommand),
    /// What the datapath holds (svc-loader).
    #[command(subcommand)]
    Bpf(bpf::BpfCommand),
    /// Conntrack garbage collection: passes, interval, totals (svc-gc).
    #[command(subcommand)]
    Gc(rivet_cli::gc::GcCommand),
    /// Connectivity to every peer node: ICMP and HTTP to its underlay addresses, HTTP to its health
    /// endpoint through the pod datapath, with latencies and the last failure (svc-health).
    Health(rivet_cli::health::HealthArgs),
    /// Stream drop (and optionally policy-verdict and trace) events live.
    ///
    /// `rivet monitor: listening` on stderr says the subscription is in
    /// place: every event after it is shown.
    Monitor {
        /// Also policy verdicts of new connections.
        #[arg(long)]
        verdicts: bool,
        /// Also trace events at every observation point.
        #[arg(long)]
        trace: bool,
        /// Only these endpoint ids.
        #[arg(long = "endpoint")]
        endpoints: Vec<u32>,
    },
    /// Run a node: start and supervise its daemons, install the CNI plugin.
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// Test pods created and deleted through the node's CNI plugin.
    #[command(subcommand)]
    Pod(pod::PodCommand),
    /// A multi-node cluster on this machine: etcd, an underlay bridge, node
    /// namespaces each running `rivet node up`.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let mut cli = Cli::parse();
    // `--node`: the state dir of that node of a cluster.
    if let Some(node) = &cli.node
        && !matches!(cli.command, Command::Cluster(_))
    {
        match cluster::find_node_dir(&cli.state_dir, node) {
            Ok(dir) => cli.state_dir = dir,
            Err(e) => {
                eprintln!("error: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    }
    // The node recorded in the state dir says where its sockets are.
    let recorded = NodeRecord::load(&cli.state_dir).ok().flatten();
    let socket_dir = match (cli.socket_dir, &recorded) {
        (Some(dir), _) => dir,
        (None, Some(node)) if !matches!(cli.command, Command::Node(node::NodeCommand::Up(_))) => {
            node.socket_dir.clone()
        }
        _ => PathBuf::from(DEFAULT_SOCKET_DIR),
    };
    let ctx = Context {
        socket_dir,
        output: cli.output,
        timeout: Duration::from_secs_f64(cli.timeout.max(0.1)),
    };
    let result = match cli.command {
        Command::Status => {
            let result = status::run(&ctx).await;
            if let (Some(node), Output::Table) = (&recorded, ctx.output) {
                print!("\n{}", node::describe_supervision(node));
            }
            return match result {
                Ok(health) => ExitCode::from(health.exit_code()),
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        // Their errors carry context chains: print them whole.
        Command::Node(c) => node::run(&ctx, &cli.state_dir, c)
            .await
            .map_err(|e| anyhow::anyhow!("{e:#}")),
        Command::Pod(c) => pod::run(&ctx, &cli.state_dir, c)
            .await
            .map_err(|e| anyhow::anyhow!("{e:#}")),
        Command::Cluster(c) => cluster::run(&ctx, &cli.state_dir, c)
            .await
            .map_err(|e| anyhow::anyhow!("{e:#}")),
        Command::Ipam(c) => ipam::run(&ctx, c).await.map(|()| true).map_err(Into::into),
        Command::Endpoint(c) => endpoint::run(&ctx, c).await.map(|()| true).map_err(Into::into),
        Command::Policy(c) => policy::run(&ctx, c).await.map_err(Into::into),
        Command::Service(c) => service::run(&ctx, c).await.map_err(Into::into),
        Command::Namespace(c) => namespace::run(&ctx, c).await.map(|()| true).map_err(Into::into),
        Command::Bpf(c) => bpf::run(&ctx, c).await.map(|()| true).map_err(Into::into),
        Command::Gc(c) => rivet_cli::gc::run(&ctx, c).await.map(|()| true).map_err(Into::into),
        Command::Health(a) => rivet_cli::health::run(&ctx, a).await.map(|()| true).map_err(Into::into),
        Command::Identity(c) => identity::run(&ctx, c).await.map(|()| true).map_err(Into::into),
        Command::Ipcache(c) => identity::run_ipcache(&ctx, c).await.map(|()| true).map_err(Into::into),
        Command::Monitor {
            verdicts,
            trace,
            endpoints,
        } => bpf::monitor(&ctx, verdicts, trace, endpoints)
            .await
            .map(|()| true)
            .map_err(Into::into),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
