//! `rivet cluster up|down|status|start-node|stop-node`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context as _, Result, bail};
use serde::Serialize;

use super::{
    ClusterPhase, ClusterRecord, NODE_DOWN_TIMEOUT, NodePlan, Routing, UNDERLAY_INTERFACE, UpArgs, cluster_dir, etcd,
    plan::ClusterPlan, topology,
};
use crate::node::{DaemonPhase, DaemonStatus, NodePhase, NodeRecord, supervisor_alive};
use crate::table::Table;
use crate::{Context, fields, netns, now_unix_nanos};

/// The running `rivet`.
fn own_exe() -> Result<PathBuf> {
    std::env::current_exe().context("locating the running rivet binary")
}

pub(super) async fn up(ctx: &Context, state_dir: &Path, args: &UpArgs) -> Result<bool> {
    let plan = ClusterPlan::new(&args.name, args.nodes, args.routing)?;
    let dir = cluster_dir(state_dir, &plan.name);
    if let Some(existing) = ClusterRecord::load(&dir)? {
        bail!(
            "cluster {} is recorded in {} already ({:?}); remove it first with `rivet --state-dir {} cluster down --name {}`",
            existing.plan.name,
            dir.display(),
            existing.phase,
            state_dir.display(),
            existing.plan.name
        );
    }
    for ns in std::iter::once(&plan.underlay_netns).chain(plan.nodes.iter().map(|n| &n.name)) {
        if netns::exists(ns) {
            bail!(
                "network namespace `{ns}` exists already: another cluster or test uses the name `{}`",
                plan.name
            );
        }
    }
    let etcd_binary = match &args.etcd_binary {
        Some(path) => path.clone(),
        None => rivet_tools::tool_path(rivet_tools::Tool::Etcd)?,
    };
    let bin_dir = match &args.bin_dir {
        Some(dir) => dir.clone(),
        None => own_exe()?.parent().map(Path::to_path_buf).unwrap_or_default(),
    };
    make_reachable_dir(&dir)?;
    let mut record = ClusterRecord {
        plan,
        phase: ClusterPhase::Starting,
        dir: dir.clone(),
        up_pid: std::process::id(),
        etcd: None,
        namespaces: Vec::new(),
        node_up_args: Vec::new(),
        bin_dir,
        created_unix_nanos: now_unix_nanos(),
    };
    record.store()?;
    match build(&mut record, args, &etcd_binary).await {
        Ok(()) => {
            record.phase = ClusterPhase::Running;
            record.store()?;
            let status = cluster_status(&record);
            ctx.print(&status, || {
                format!(
                    "{}stop it with `rivet --state-dir {} cluster down --name {}`\n",
                    status.render(),
                    state_dir.display(),
                    record.plan.name
                )
            });
            Ok(true)
        }
        Err(e) => {
            eprintln!(
                "rivet cluster: cluster {} did not come up; removing it",
                record.plan.name
            );
            let _ = down(&dir).await;
            Err(e)
        }
    }
}

/// etcd, the namespaces, the nodes; each piece recorded before it is made.
async fn build(record: &mut ClusterRecord, args: &UpArgs, etcd_binary: &Path) -> Result<()> {
    let etcd_dir = record.dir.join("etcd");
    let etcd_name = format!("{}-etcd", record.plan.name);
    // Blocking for a moment: nothing else runs yet.
    let etcd = etcd::start(etcd_binary, &etcd_name, &etcd_dir, |running| {
        record.etcd = Some(running.clone());
        record.store()
    })?;
    eprintln!("rivet cluster: etcd {} (pid {})", etcd.endpoint, etcd.pid);
    record.node_up_args = node_up_args(&etcd.endpoint, &record.plan, args);
    record.store()?;

    let plan = record.plan.clone();
    let mut created = |ns: &str| {
        record.namespaces.push(ns.to_string());
        record.store()
    };
    topology::create_underlay(&plan, &mut created)?;
    for node in &plan.nodes {
        topology::create_node(&plan, node, &mut created)?;
    }
    eprintln!(
        "rivet cluster: underlay {} (bridge, {} nodes on it)",
        plan.underlay_netns,
        plan.nodes.len()
    );

    let mut starts = tokio::task::JoinSet::new();
    for node in &plan.nodes {
        let command = node_up_command(record, node)?;
        let name = node.name.clone();
        starts.spawn(async move { (name, run_rivet(command).await) });
    }
    let mut failures = Vec::new();
    while let Some(done) = starts.join_next().await {
        let (name, outcome) = done.context("waiting for a node to start")?;
        match outcome {
            Ok(_) => eprintln!("rivet cluster: node {name} up"),
            Err(e) => failures.push(format!("node {name}: {e:#}")),
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}

/// The flags every node's `rivet node up` gets after its own: the
/// cluster's etcd, routing mode and name, and `ul0` as the underlay.
fn node_up_args(etcd_endpoint: &str, plan: &ClusterPlan, args: &UpArgs) -> Vec<String> {
    let mut out = vec![
        "--etcd-endpoints".to_string(),
        etcd_endpoint.to_string(),
        "--routing".into(),
        plan.routing.as_str().into(),
        "--underlay-interface".into(),
        UNDERLAY_INTERFACE.into(),
        "--cluster-name".into(),
        plan.name.clone(),
        "--stop-grace-seconds".into(),
        args.stop_grace_seconds.to_string(),
        // svc-health's probes through the pod datapath start and end there.
        "--health-endpoint".into(),
    ];
    for cidr in &args.service_cidrs {
        out.extend(["--service-cidr".to_string(), cidr.to_string()]);
    }
    for d in &args.daemon_args {
        out.extend(["--daemon-arg".to_string(), d.clone()]);
    }
    out
}

/// `rivet --state-dir <node-dir> --socket-dir <node-dir>/sockets node up
/// --detach ...` for `node`.
fn node_up_command(record: &ClusterRecord, node: &NodePlan) -> Result<tokio::process::Command> {
    let node_dir = record.node_dir(&node.name);
    make_reachable_dir(&node_dir)?;
    let mut args: Vec<OsString> = vec![
        "--state-dir".into(),
        node_dir.clone().into(),
        "--socket-dir".into(),
        record.socket_dir(&node.name).into(),
        "node".into(),
        "up".into(),
        "--detach".into(),
        "--netns".into(),
        node.name.clone().into(),
        "--node-name".into(),
        node.name.clone().into(),
        "--pool".into(),
        node.pool().into(),
        "--bin-dir".into(),
        record.bin_dir.clone().into(),
        "--cni-bin-dir".into(),
        node_dir.join("cni/bin").into(),
        "--cni-conf-dir".into(),
        node_dir.join("cni/net.d").into(),
    ];
    args.extend(record.node_up_args.iter().map(OsString::from));
    let mut command = tokio::process::Command::new(own_exe()?);
    command.args(args).stdin(Stdio::null());
    Ok(command)
}

/// Runs a `rivet` child to completion; its stdout, or an error with its output.
async fn run_rivet(mut command: tokio::process::Command) -> Result<String> {
    let out = command.output().await.context("running rivet")?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{} ({}):\n{}{}",
            describe(command.as_std()),
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}

fn describe(command: &std::process::Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A directory the daemons' users can traverse (they reach their state
/// dirs below it).
fn make_reachable_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} reachable", dir.display()))
}

/// Removes the cluster of `dir`: every node (`rivet node down`), etcd, the
/// namespaces, the dir. Ok(false) when something could not be removed (it
/// is named).
pub(super) async fn down(dir: &Path) -> Result<bool> {
    let Some(mut record) = ClusterRecord::load(dir)? else {
        println!("no cluster recorded in {}: nothing to remove", dir.display());
        return Ok(true);
    };
    record.phase = ClusterPhase::Stopping;
    record.store()?;
    let mut problems = Vec::new();
    let mut stops = tokio::task::JoinSet::new();
    for node in &record.plan.nodes {
        if NodeRecord::load(&record.node_dir(&node.name)).ok().flatten().is_none() {
            continue;
        }
        let command = node_down_command(&record, &node.name)?;
        let name = node.name.clone();
        stops.spawn(async move { (name, run_rivet(command).await) });
    }
    while let Some(done) = stops.join_next().await {
        match done {
            Ok((name, Ok(_))) => println!("node {name} stopped"),
            Ok((name, Err(e))) => problems.push(format!("stopping node {name}: {e:#}")),
            Err(e) => problems.push(format!("stopping a node: {e}")),
        }
    }
    if let Some(etcd) = &record.etcd {
        etcd::stop(etcd, std::time::Duration::from_secs(5));
        println!("etcd (pid {}) stopped", etcd.pid);
    }
    for ns in record.namespaces.iter().rev() {
        match netns::delete(ns) {
            Ok(()) => println!("deleted network namespace {ns}"),
            Err(e) => problems.push(format!("{e:#}")),
        }
    }
    if problems.is_empty() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        println!("cluster {} removed", record.plan.name);
        Ok(true)
    } else {
        for p in &problems {
            eprintln!("rivet cluster: {p}");
        }
        eprintln!(
            "rivet cluster: {} kept for another `rivet cluster down --name {}`",
            dir.display(),
            record.plan.name
        );
        Ok(false)
    }
}

/// `rivet cluster restart-etcd`: etcd crashed and started again on its
/// ports and data, recorded in cluster.json before the wait for health.
pub(super) fn restart_etcd(mut record: ClusterRecord, binary: Option<PathBuf>) -> Result<etcd::EtcdRecord> {
    let old = record
        .etcd
        .clone()
        .with_context(|| format!("cluster {} has no etcd recorded", record.plan.name))?;
    let binary = match binary.or_else(|| old.binary.clone()) {
        Some(path) => path,
        None => rivet_tools::tool_path(rivet_tools::Tool::Etcd)?,
    };
    let name = format!("{}-etcd", record.plan.name);
    etcd::restart(&binary, &name, &old, |running| {
        record.etcd = Some(running.clone());
        record.store()
    })
}

fn node_down_command(record: &ClusterRecord, node: &str) -> Result<tokio::process::Command> {
    let mut command = tokio::process::Command::new(own_exe()?);
    command
        .arg("--state-dir")
        .arg(record.node_dir(node))
        .args(["node", "down", "--timeout-seconds"])
        .arg(NODE_DOWN_TIMEOUT.as_secs().to_string())
        .stdin(Stdio::null());
    Ok(command)
}

/// `rivet cluster stop-node`: a clean leave.
pub(super) async fn stop_node(record: &ClusterRecord, node: &str) -> Result<bool> {
    let out = run_rivet(node_down_command(record, node)?).await?;
    print!("{out}");
    Ok(true)
}

/// `rivet cluster start-node`: the node's `rivet node up` again, after a
/// cleanup of what a crashed node left.
pub(super) async fn start_node(record: &ClusterRecord, node: &NodePlan) -> Result<bool> {
    if let Some(existing) = record.node_record(&node.name)? {
        if supervisor_alive(existing.supervisor_pid) {
            bail!(
                "node {} is running (supervisor pid {})",
                node.name,
                existing.supervisor_pid
            );
        }
        let out = run_rivet(node_down_command(record, &node.name)?).await?;
        print!("{out}");
    }
    let out = run_rivet(node_up_command(record, node)?).await?;
    print!("{out}");
    Ok(true)
}

/// etcd's state in `rivet cluster status`.
#[derive(Debug, Clone, Serialize)]
pub struct EtcdStatus {
    /// Client URL.
    pub endpoint: String,
    /// Its pid.
    pub pid: u32,
    /// It answers `GET /health` healthy.
    pub healthy: bool,
}

/// One node in `rivet cluster status`.
#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    /// Node name (and namespace).
    pub name: String,
    /// Underlay addresses.
    pub underlay: Vec<String>,
    /// Pod CIDRs.
    pub pod_cidrs: Vec<String>,
    /// `running`, `starting`, `stopping`, `stopped` (no node.json) or
    /// `crashed` (node.json without its supervisor).
    pub state: String,
    /// The state dir (`rivet --node <name>` finds it too).
    pub state_dir: PathBuf,
    /// The supervisor's pid.
    pub supervisor_pid: Option<u32>,
    /// Its daemons.
    pub daemons: Vec<DaemonStatus>,
}

/// `rivet cluster status`.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterStatus {
    /// Cluster name.
    pub name: String,
    /// Routing mode.
    pub routing: Routing,
    /// Lifecycle phase.
    pub phase: ClusterPhase,
    /// The cluster dir.
    pub dir: PathBuf,
    /// The underlay namespace.
    pub underlay_netns: String,
    /// etcd, once started.
    pub etcd: Option<EtcdStatus>,
    /// The nodes.
    pub nodes: Vec<NodeStatus>,
}

impl ClusterStatus {
    /// etcd is healthy, no node crashed and every node that runs runs all
    /// its daemons (a node stopped with `stop-node` is no problem).
    pub fn healthy(&self) -> bool {
        self.etcd.as_ref().is_some_and(|e| e.healthy)
            && self.nodes.iter().all(|n| match n.state.as_str() {
                "stopped" => true,
                "running" => n.daemons.iter().all(|d| d.phase == DaemonPhase::Running),
                _ => false,
            })
    }

    /// As printed.
    pub fn render(&self) -> String {
        let etcd = self.etcd.as_ref().map_or("-".to_string(), |e| {
            format!(
                "{} (pid {}, {})",
                e.endpoint,
                e.pid,
                if e.healthy { "healthy" } else { "NOT healthy" }
            )
        });
        let mut out = fields([
            ("CLUSTER", self.name.clone()),
            ("ROUTING", self.routing.as_str().to_string()),
            ("PHASE", format!("{:?}", self.phase).to_lowercase()),
            ("ETCD", etcd),
            (
                "UNDERLAY",
                format!("namespace {}, bridge {}", self.underlay_netns, super::BRIDGE),
            ),
            ("DIR", self.dir.display().to_string()),
        ]);
        let mut t = Table::new(["NODE", "STATE", "UNDERLAY", "POD CIDRS", "DAEMONS"]);
        for n in &self.nodes {
            let running = n.daemons.iter().filter(|d| d.phase == DaemonPhase::Running).count();
            t.row([
                n.name.clone(),
                n.state.clone(),
                n.underlay.join(","),
                n.pod_cidrs.join(","),
                format!("{running}/{} running", n.daemons.len()),
            ]);
        }
        out.push('\n');
        out.push_str(&t.render());
        out
    }
}

/// The status of the recorded cluster, from cluster.json, the nodes'
/// node.json and probes of etcd.
pub fn cluster_status(record: &ClusterRecord) -> ClusterStatus {
    let etcd = record.etcd.as_ref().map(|e| EtcdStatus {
        endpoint: e.endpoint.clone(),
        pid: e.pid,
        healthy: etcd::alive(e) && etcd::healthy(e.client_addr),
    });
    let nodes = record
        .plan
        .nodes
        .iter()
        .map(|n| {
            let node = record.node_record(&n.name).ok().flatten();
            let state = match &node {
                None => "stopped".to_string(),
                Some(r) if !supervisor_alive(r.supervisor_pid) => "crashed".to_string(),
                Some(r) => match r.phase {
                    NodePhase::Starting => "starting",
                    NodePhase::Running => "running",
                    NodePhase::Stopping => "stopping",
                }
                .to_string(),
            };
            NodeStatus {
                name: n.name.clone(),
                underlay: vec![n.underlay_v4.to_string(), n.underlay_v6.to_string()],
                pod_cidrs: vec![n.pod_cidr_v4.clone(), n.pod_cidr_v6.clone()],
                state,
                state_dir: record.node_dir(&n.name),
                supervisor_pid: node.as_ref().map(|r| r.supervisor_pid),
                daemons: node.map(|r| r.daemons).unwrap_or_default(),
            }
        })
        .collect();
    ClusterStatus {
        name: record.plan.name.clone(),
        routing: record.plan.routing,
        phase: record.phase,
        dir: record.dir.clone(),
        underlay_netns: record.plan.underlay_netns.clone(),
        etcd,
        nodes,
    }
}
