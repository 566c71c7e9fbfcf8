//! Chaos under churn (issue 19 §1): a randomised run against a real
//! multi-node `rivet cluster up` ([`crate::cluster`]) that adds and deletes
//! pods, applies and removes policies, kills node daemons with SIGKILL
//! (also while a pod is being added on their node) and crashes etcd, and
//! checks Rivet's promises while it does:
//!
//! - **addresses**: no address is held by two pods (svc-ipam's allocations
//!   and svc-endpoint's endpoints, against what rivet-cni reported);
//! - **policy**: pods rivet-cni reported ready reach each other exactly as
//!   the policies in force say (a few sampled pairs per check, TCP to an
//!   echo server, IPv4 or IPv6), probed only once the cluster settled: every
//!   node's svc-loader holds its peers and the other nodes' pods, and every
//!   endpoint is ready with its policy revision realised in the datapath;
//!   a wrong answer is probed again while the cluster settles and is a
//!   violation only if it persists ([`PROBE_CONVERGE`]);
//! - **flows**: two long-lived ping streams between pods on different
//!   nodes, which no policy selects, lose no packet across the kills and
//!   etcd restarts;
//! - **leaks**: at the end, with every pod and policy deleted, each node
//!   holds what it held before the first pod ([`Inventory`]: addresses,
//!   endpoints, identity references, the endpoint, policy and ipcache map
//!   entries, interfaces, tc filters, state dir entries, sockets), the
//!   pods' network namespaces are gone, etcd holds no key it did not hold
//!   then (except identity master keys: rivet-operator's identity GC
//!   deletes those and `rivet cluster up` runs no operator), and after two
//!   more passes of svc-gc (its interval shortened to [`GC_MAX_INTERVAL`]) no
//!   conntrack entry has an address of a deleted pod.
//!
//! One seeded RNG ([`ChaosRng`], SplitMix64) makes every choice (the
//! action, node, daemon, pod, policy and probed pair), so a run is replayed
//! by its seed as long as the cluster answers the same way (a failed add
//! changes the pods chosen later). Every violation names the seed and the
//! step ([`Violation`]); [`Summary`] counts what the run did.
//!
//! `cargo xtask chaos` runs [`run`] through the `rivet-chaos` binary;
//! `e2e/tests/chaos.rs` runs a short fixed-seed run in the suite.
//!
//! Needs root, a bpffs, the rivet users and etcd 3.6 (`cargo xtask
//! install`) and the workspace binaries (`cargo build --bins`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::gc::v1 as gcpb;
use rivet_proto::gc::v1::gc_service_client::GcServiceClient;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use rivet_proto::loader::v1 as ldpb;

use crate::cluster::{Cluster, ClusterError, ClusterNode, ClusterOptions, ClusterPod, NodeState, Routing};
use crate::traffic::Pinger;

/// The label sets of churned pods: `app=<x>`, in namespace [`NAMESPACE`].
pub const APPS: [&str; 4] = ["a", "b", "c", "d"];
/// The namespace of churned pods and of the policies.
pub const NAMESPACE: &str = "chaos";
/// The namespace of the long-lived flows' pods (no policy selects them).
pub const FLOW_NAMESPACE: &str = "flow";
/// The daemons a run kills.
pub const DAEMONS: [&str; 5] = ["svc-loader", "svc-gc", "svc-ipam", "svc-identity", "svc-endpoint"];
/// The port of the probes' echo server.
const PROBE_PORT: u16 = 8080;
/// How long an allowed probe may take to get its echo.
const ALLOWED_WITHIN: Duration = Duration::from_secs(5);
/// How long a denied probe's connection is given to (wrongly) succeed.
const DENIED_WITHIN: Duration = Duration::from_secs(1);
/// How long a probe may keep answering against the policy while the
/// cluster settles (an identity new to a node reaches its selector cache
/// through a watch) before it is a violation.
pub const PROBE_CONVERGE: Duration = Duration::from_secs(20);
/// How long the cluster may take to settle after a step.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the nodes may take to return to their state before the run
/// once everything is deleted.
const END_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(100);
/// The flows: one echo request every 2 ms, counted in runs of 500.
const FLOW_INTERVAL: Duration = Duration::from_millis(2);
const FLOW_BATCH: u32 = 500;
/// How long a flow may take to complete a run (a restart under way).
const FLOW_RUN_WITHIN: Duration = Duration::from_secs(30);
/// svc-gc's longest interval in a run, so the end waits for its passes
/// seconds, not half an hour.
pub const GC_MAX_INTERVAL: Duration = Duration::from_secs(5);
/// Pods a run keeps at least (adds are forced below).
const MIN_PODS: usize = 4;
/// A run allowed more live pods than this biases its adds toward its
/// `max_pods` (else adds barely outweigh deletes and 200 live pods take
/// hours); smaller runs, the suite's (30) among them, keep the balanced
/// weights their seeds were chosen with.
const FILL_BIAS_ABOVE: usize = 50;
/// The add weight a run far below its max gets on top of the base 30
/// (scaled by how far below it is).
const FILL_BIAS: usize = 60;

/// What [`run`] does.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    /// Seed of every choice.
    pub seed: u64,
    /// How long the churn goes on (the end's checks come after).
    pub duration: Duration,
    /// Steps the churn makes at least, however long they take: the seed's
    /// choices up to that step (a fault of each kind, say) happen also on a
    /// loaded machine, where fewer steps fit in `duration`.
    pub min_steps: u64,
    /// Nodes (2 or 3).
    pub nodes: usize,
    /// Churned pods live at most at once.
    pub max_pods: usize,
    /// Pairs probed per check.
    pub probes_per_check: usize,
    /// Routing mode.
    pub routing: Routing,
    /// Where `rivet` and the daemons are; `None`: beside the running binary.
    pub bin_dir: Option<PathBuf>,
    /// Where the cluster's logs (every `*.log` under its dir, the daemons'
    /// and etcd's) are copied before it goes down when there was a
    /// violation; `None`: not kept.
    pub keep_logs: Option<PathBuf>,
}

impl ChaosOptions {
    /// A long run: `minutes` of churn, up to 200 pods, 3 nodes.
    pub fn long(seed: u64, minutes: u64) -> Self {
        Self {
            seed,
            duration: Duration::from_secs(minutes * 60),
            min_steps: 0,
            nodes: 3,
            max_pods: 200,
            probes_per_check: 4,
            routing: Routing::Native,
            bin_dir: None,
            keep_logs: None,
        }
    }
}

/// One broken promise, with what replays it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The run's seed.
    pub seed: u64,
    /// The step during or after which it was seen (0: before the churn;
    /// the end's checks count on from the last step).
    pub step: u64,
    /// Which invariant (`addresses`, `policy`, `flow`, `settle`, `leak`,
    /// `conntrack`, `add`, `delete`, `harness`).
    pub invariant: &'static str,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {} step {}: {}: {}",
            self.seed, self.step, self.invariant, self.detail
        )
    }
}

/// What a run did and found.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// The seed.
    pub seed: u64,
    /// Steps of churn.
    pub steps: u64,
    /// Pods added (rivet-cni reported them ready).
    pub adds: u64,
    /// Adds that failed (while a daemon of their node was killed, or not).
    pub failed_adds: u64,
    /// Pods deleted.
    pub deletes: u64,
    /// Most pods live at once.
    pub most_pods: usize,
    /// kill -9 by daemon.
    pub kills: BTreeMap<String, u64>,
    /// Of the kills, those made while a pod was being added on the node.
    pub kills_during_add: u64,
    /// etcd crashed and started again.
    pub etcd_restarts: u64,
    /// Policies applied and deleted.
    pub policies_applied: u64,
    /// Policies deleted.
    pub policies_deleted: u64,
    /// Checks (addresses and a probe matrix).
    pub checks: u64,
    /// Pairs probed, those expected to connect and those expected refused.
    pub probes: u64,
    /// Probes that policy allows.
    pub probes_allowed: u64,
    /// Probes that policy denies.
    pub probes_denied: u64,
    /// Probes repeated while the cluster settled.
    pub probe_retries: u64,
    /// Echo requests of the long-lived flows.
    pub flow_sent: u64,
    /// Of them, lost.
    pub flow_lost: u64,
    /// Wall time of the whole run (cluster up to down).
    pub elapsed: Duration,
    /// Every violation, in order.
    pub violations: Vec<Violation>,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "chaos seed {}: {} steps in {:.0?}",
            self.seed, self.steps, self.elapsed
        )?;
        writeln!(
            f,
            "  pods: {} added ({} adds failed), {} deleted, at most {} live",
            self.adds, self.failed_adds, self.deletes, self.most_pods
        )?;
        let kills: Vec<String> = self.kills.iter().map(|(d, n)| format!("{d} {n}")).collect();
        writeln!(
            f,
            "  kill -9: {} ({} during an add); etcd restarts: {}",
            if kills.is_empty() {
                "none".to_string()
            } else {
                kills.join(", ")
            },
            self.kills_during_add,
            self.etcd_restarts
        )?;
        writeln!(
            f,
            "  policies: {} applied, {} deleted; checks: {}; probes: {} ({} allowed, {} denied, {} repeated while settling)",
            self.policies_applied,
            self.policies_deleted,
            self.checks,
            self.probes,
            self.probes_allowed,
            self.probes_denied,
            self.probe_retries
        )?;
        writeln!(f, "  flows: {} echo requests, {} lost", self.flow_sent, self.flow_lost)?;
        if self.violations.is_empty() {
            write!(f, "  no violation")
        } else {
            write!(f, "  {} violations:", self.violations.len())?;
            for v in &self.violations {
                write!(f, "\n    {v}")?;
            }
            Ok(())
        }
    }
}

/// Why a run could not be made at all (violations are in [`Summary`]).
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// `rivet cluster up` failed.
    #[error("starting the chaos cluster: {0}")]
    Cluster(#[from] ClusterError),
    /// Options out of range.
    #[error("chaos options: {0}")]
    Options(String),
}

/// A policy a run applies and removes: `app=<to>` pods admit or refuse
/// `app=<from>` pods (indexes into [`APPS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PolicySpec {
    /// Deny (a RivetNetworkPolicy's `ingressDeny`, default deny off) or
    /// allow (a NetworkPolicy: the selected pods admit only what such
    /// policies allow).
    pub deny: bool,
    /// The selected pods' app.
    pub to: usize,
    /// The peer pods' app.
    pub from: usize,
}

impl PolicySpec {
    /// Every policy a run may apply.
    pub fn all() -> Vec<PolicySpec> {
        let mut all = Vec::new();
        for deny in [false, true] {
            for to in 0..APPS.len() {
                for from in 0..APPS.len() {
                    all.push(PolicySpec { deny, to, from });
                }
            }
        }
        all
    }

    /// Its name in [`NAMESPACE`].
    pub fn name(&self) -> String {
        let verb = if self.deny { "deny" } else { "allow" };
        format!("{verb}-{}-from-{}", APPS[self.to], APPS[self.from])
    }

    /// Its key for `rivet policy delete`.
    pub fn key(&self) -> String {
        if self.deny {
            format!("RivetNetworkPolicy/{NAMESPACE}/{}", self.name())
        } else {
            format!("{NAMESPACE}/{}", self.name())
        }
    }

    /// The document.
    pub fn yaml(&self) -> String {
        let (to, from, name) = (APPS[self.to], APPS[self.from], self.name());
        if self.deny {
            format!(
                "apiVersion: rivet.io/v1\nkind: RivetNetworkPolicy\nmetadata: {{name: {name}, namespace: {NAMESPACE}}}\n\
                 spec:\n  podSelector: {{matchLabels: {{app: {to}}}}}\n  \
                 enableDefaultDeny: {{ingress: false, egress: false}}\n  \
                 ingressDeny: [{{from: [{{podSelector: {{matchLabels: {{app: {from}}}}}}}]}}]\n"
            )
        } else {
            format!(
                "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {NAMESPACE}}}\n\
                 spec:\n  podSelector: {{matchLabels: {{app: {to}}}}}\n  \
                 ingress: [{{from: [{{podSelector: {{matchLabels: {{app: {from}}}}}}}]}}]\n"
            )
        }
    }
}

/// The oracle: whether an `app=<from>` pod reaches an `app=<to>` pod (both
/// in [`NAMESPACE`]) under the `active` policies. Allow policies selecting
/// the destination make it admit only their peers (a union); a deny
/// selecting it refuses its peer whatever allows it.
pub fn allowed(active: &BTreeSet<PolicySpec>, from: usize, to: usize) -> bool {
    let selecting: Vec<&PolicySpec> = active.iter().filter(|p| p.to == to).collect();
    if selecting.iter().any(|p| p.deny && p.from == from) {
        return false;
    }
    let allows: Vec<&&PolicySpec> = selecting.iter().filter(|p| !p.deny).collect();
    allows.is_empty() || allows.iter().any(|p| p.from == from)
}

/// The run's random numbers: SplitMix64 (Steele, Lea and Flood), whose
/// stream for a seed is fixed here, so a seed replays a run on any build.
#[derive(Debug, Clone)]
pub struct ChaosRng(u64);

impl ChaosRng {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..bound` (`bound` > 0; the modulo bias is below
    /// 2^-50 for the small bounds used here).
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "a bound above 0");
        self.next_u64() % bound
    }

    /// An index into a collection of `len` > 0 items.
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// One item of a non-empty slice.
    pub fn choose<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.index(items.len())]
    }
}

/// One step's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Add,
    Delete,
    ApplyPolicy,
    DeletePolicy,
    Kill,
    KillDuringAdd,
    RestartEtcd,
    Check,
}

/// The weight of an add with `live` of `max` pods (room left): 30, plus up
/// to [`FILL_BIAS`] by how far below its max a large run is.
fn add_weight(live: usize, max: usize) -> u32 {
    let bias = if max > FILL_BIAS_ABOVE {
        FILL_BIAS * max.saturating_sub(live) / max
    } else {
        0
    };
    30 + bias as u32
}

/// The next action, weighted by what the cluster holds.
fn choose_action(rng: &mut ChaosRng, live: usize, max: usize, active: usize, candidates: usize) -> Action {
    if live < MIN_PODS.min(max) {
        return Action::Add;
    }
    let room = live < max;
    let weights = [
        (Action::Add, if room { add_weight(live, max) } else { 0 }),
        (Action::Delete, if live > 0 { 22 } else { 0 }),
        (Action::ApplyPolicy, if active < candidates { 12 } else { 0 }),
        (Action::DeletePolicy, if active > 0 { 7 } else { 0 }),
        (Action::Kill, 8),
        (Action::KillDuringAdd, if room { 4 } else { 0 }),
        (Action::RestartEtcd, 3),
        (Action::Check, 14),
    ];
    let total: u32 = weights.iter().map(|(_, w)| w).sum();
    let mut pick = rng.below(u64::from(total)) as u32;
    for (action, weight) in weights {
        if pick < weight {
            return action;
        }
        pick -= weight;
    }
    unreachable!("the pick is below the total weight")
}

/// A churned pod and its app (index into [`APPS`]).
struct LivePod {
    pod: ClusterPod,
    app: usize,
}

/// A long-lived ping stream and the losses already reported.
struct Flow {
    what: String,
    pinger: Pinger,
    lost_seen: u64,
}

/// What a node holds, by category, each item one line that stays the same
/// across daemon restarts (no pids, boot ids or kernel ids).
pub type Inventory = BTreeMap<String, BTreeSet<String>>;

/// Runs the chaos: a cluster up, the churn for `options.duration`, the
/// end's checks, the cluster down. Violations are in the summary; `Err`
/// only when the cluster could not be made.
pub async fn run(options: &ChaosOptions) -> Result<Summary, ChaosError> {
    if !(2..=3).contains(&options.nodes) {
        return Err(ChaosError::Options(format!(
            "--nodes must be 2 or 3, not {}",
            options.nodes
        )));
    }
    if options.max_pods < 2 {
        return Err(ChaosError::Options(format!(
            "at least 2 pods are needed to probe, not {}",
            options.max_pods
        )));
    }
    let started = Instant::now();
    let gc_max = GC_MAX_INTERVAL.as_secs().to_string();
    let cluster = Cluster::start(ClusterOptions {
        nodes: options.nodes,
        routing: options.routing,
        daemon_args: vec![
            "svc-gc=--start-interval-seconds=1".into(),
            "svc-gc=--min-interval-seconds=1".into(),
            format!("svc-gc=--max-interval-seconds={gc_max}"),
        ],
        bin_dir: options.bin_dir.clone(),
        ..Default::default()
    })
    .await?;
    eprintln!(
        "chaos: seed {}, cluster {} ({} nodes, {:?}), {:?} of churn, up to {} pods",
        options.seed, cluster.name, options.nodes, options.routing, options.duration, options.max_pods
    );
    eprintln!("chaos: cluster up in {:.1?}", started.elapsed());
    let mut chaos = Chaos {
        options: options.clone(),
        rng: ChaosRng::new(options.seed),
        cluster,
        live: Vec::new(),
        flow_pods: Vec::new(),
        flows: Vec::new(),
        active: BTreeSet::new(),
        candidates: PolicySpec::all(),
        pod_addresses: BTreeSet::new(),
        step: 0,
        next_pod: 0,
        summary: Summary {
            seed: options.seed,
            ..Default::default()
        },
    };
    let outcome = std::panic::AssertUnwindSafe(chaos.churn_and_check())
        .catch_unwind()
        .await;
    if let Err(panic) = outcome {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        chaos.violation("harness", format!("the run stopped: {message}"));
    }
    let Chaos {
        cluster, mut summary, ..
    } = chaos;
    if let Some(dir) = &options.keep_logs
        && !summary.violations.is_empty()
    {
        match copy_logs(&cluster.record().dir, dir) {
            Ok(n) => eprintln!("chaos: {n} log files copied to {}", dir.display()),
            Err(e) => eprintln!("chaos: copying the logs to {}: {e}", dir.display()),
        }
    }
    let down = Instant::now();
    cluster.down().await;
    eprintln!("chaos: cluster down in {:.1?}", down.elapsed());
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// The run's state.
struct Chaos {
    options: ChaosOptions,
    rng: ChaosRng,
    cluster: Cluster,
    live: Vec<LivePod>,
    flow_pods: Vec<ClusterPod>,
    flows: Vec<Flow>,
    active: BTreeSet<PolicySpec>,
    candidates: Vec<PolicySpec>,
    /// Every address a churned or flow pod ever had.
    pod_addresses: BTreeSet<IpAddr>,
    step: u64,
    next_pod: u64,
    summary: Summary,
}

impl Chaos {
    /// Records and prints a violation.
    fn violation(&mut self, invariant: &'static str, detail: String) {
        let v = Violation {
            seed: self.options.seed,
            step: self.step,
            invariant,
            detail,
        };
        eprintln!("chaos VIOLATION {v}");
        self.summary.violations.push(v);
    }

    async fn churn_and_check(&mut self) {
        if !self.settle().await {
            return;
        }
        let baseline = inventory(&self.cluster).await;
        self.start_flows().await;
        let deadline = Instant::now() + self.options.duration;
        while Instant::now() < deadline || self.step < self.options.min_steps {
            self.step += 1;
            let action = choose_action(
                &mut self.rng,
                self.live.len(),
                self.options.max_pods,
                self.active.len(),
                self.candidates.len(),
            );
            eprintln!("chaos: step {}: {action:?}", self.step);
            match action {
                Action::Add => self.add(None).await,
                Action::KillDuringAdd => {
                    let daemon = *self.rng.choose(&DAEMONS);
                    self.add(Some(daemon)).await;
                    self.after_fault().await;
                }
                Action::Delete => self.delete().await,
                Action::ApplyPolicy => self.apply_policy().await,
                Action::DeletePolicy => self.delete_policy().await,
                Action::Kill => {
                    let node = 1 + self.rng.index(self.options.nodes);
                    let daemon = *self.rng.choose(&DAEMONS);
                    eprintln!("chaos: step {}: kill -9 {daemon} of node {node}", self.step);
                    self.cluster.kill9(node, daemon).await;
                    *self.summary.kills.entry(daemon.to_string()).or_default() += 1;
                    self.after_fault().await;
                }
                Action::RestartEtcd => {
                    if let Err(e) = self.cluster.restart_etcd().await {
                        self.violation("harness", format!("restarting etcd: {e}"));
                        return;
                    }
                    self.summary.etcd_restarts += 1;
                    self.after_fault().await;
                }
                Action::Check => self.check().await,
            }
            self.summary.steps = self.step;
            self.summary.most_pods = self.summary.most_pods.max(self.live.len());
            if self.step.is_multiple_of(25) {
                eprintln!(
                    "chaos: step {}, {} pods live, {} policies, {} violations",
                    self.step,
                    self.live.len(),
                    self.active.len(),
                    self.summary.violations.len()
                );
            }
        }
        // The end: a last check, the flows' totals, then everything deleted.
        let end = Instant::now();
        self.step += 1;
        self.check().await;
        self.stop_flows();
        self.delete_everything().await;
        eprintln!("chaos: the end: checked and deleted in {:.1?}", end.elapsed());
        self.wait_back_to(&baseline).await;
        eprintln!("chaos: the end: back to the start in {:.1?}", end.elapsed());
        self.check_conntrack(&baseline).await;
        eprintln!("chaos: the end: conntrack checked in {:.1?}", end.elapsed());
    }

    /// A pod on a random node with a random app; with `kill`, that daemon
    /// of the node is killed -9 while the add runs.
    async fn add(&mut self, kill: Option<&'static str>) {
        let node = 1 + self.rng.index(self.options.nodes);
        let app = self.rng.index(APPS.len());
        self.next_pod += 1;
        let name = format!("p{}", self.next_pod);
        let label = format!("app={}", APPS[app]);
        let added = match kill {
            Some(daemon) => {
                eprintln!(
                    "chaos: step {}: kill -9 {daemon} of node {node} during the add of {name}",
                    self.step
                );
                let added = self
                    .cluster
                    .try_add_pod_during_kill9(node, NAMESPACE, &name, &[&label], daemon)
                    .await;
                *self.summary.kills.entry(daemon.to_string()).or_default() += 1;
                self.summary.kills_during_add += 1;
                added
            }
            None => self.cluster.try_add_pod(node, NAMESPACE, &name, &[&label]).await,
        };
        let pod = match added {
            Ok(pod) => pod,
            Err(e) if kill.is_some() => {
                // A runtime retries a failed ADD; the end checks it left nothing.
                self.summary.failed_adds += 1;
                eprintln!("chaos: step {}: add of {name} failed during kill -9: {e}", self.step);
                return;
            }
            Err(first) => {
                self.summary.failed_adds += 1;
                self.settle().await;
                match self.cluster.try_add_pod(node, NAMESPACE, &name, &[&label]).await {
                    Ok(pod) => pod,
                    Err(e) => {
                        self.summary.failed_adds += 1;
                        self.violation(
                            "add",
                            format!("adding {NAMESPACE}/{name} on node {node} failed twice, the second time on a settled cluster: {first}\nthen: {e}"),
                        );
                        return;
                    }
                }
            }
        };
        self.summary.adds += 1;
        eprintln!(
            "chaos: step {}: {NAMESPACE}/{name} (app={}) on node {node}: {} {}",
            self.step, APPS[app], pod.ipv4, pod.ipv6
        );
        self.pod_addresses.extend(pod.addrs());
        self.live.push(LivePod { pod, app });
    }

    /// Deletes a random pod (a DEL that fails is retried once settled).
    async fn delete(&mut self) {
        let index = self.rng.index(self.live.len());
        let pod = self.live.swap_remove(index);
        self.delete_pod(pod).await;
    }

    async fn delete_pod(&mut self, live: LivePod) {
        eprintln!(
            "chaos: step {}: deleting {}/{} on node {} ({} {})",
            self.step, live.pod.namespace, live.pod.name, live.pod.node, live.pod.ipv4, live.pod.ipv6
        );
        if let Err(first) = self.cluster.try_delete_pod(&live.pod).await {
            self.settle().await;
            if let Err(e) = self.cluster.try_delete_pod(&live.pod).await {
                self.violation(
                    "delete",
                    format!(
                        "deleting {}/{} on node {} failed twice: {first}\nthen: {e}",
                        live.pod.namespace, live.pod.name, live.pod.node
                    ),
                );
                self.live.push(live);
                return;
            }
        }
        self.summary.deletes += 1;
    }

    async fn apply_policy(&mut self) {
        let inactive: Vec<PolicySpec> = self
            .candidates
            .iter()
            .filter(|p| !self.active.contains(p))
            .copied()
            .collect();
        let policy = *self.rng.choose(&inactive);
        eprintln!("chaos: step {}: applying {}", self.step, policy.key());
        self.cluster.apply_policy(&policy.yaml()).await;
        self.active.insert(policy);
        self.summary.policies_applied += 1;
    }

    async fn delete_policy(&mut self) {
        let active: Vec<PolicySpec> = self.active.iter().copied().collect();
        let policy = *self.rng.choose(&active);
        eprintln!("chaos: step {}: deleting {}", self.step, policy.key());
        self.cluster.delete_policy(&policy.key()).await;
        self.active.remove(&policy);
        self.summary.policies_deleted += 1;
    }

    /// After a kill or an etcd restart: the cluster settles and the flows
    /// completed a run since.
    async fn after_fault(&mut self) {
        self.settle().await;
        self.check_flows();
    }

    /// Addresses, then a probe matrix, on a settled cluster.
    async fn check(&mut self) {
        self.summary.checks += 1;
        if !self.settle().await {
            return;
        }
        self.check_addresses().await;
        self.probe_matrix().await;
    }

    /// Waits until the cluster settled ([`unsettled`]); a violation after
    /// [`SETTLE_TIMEOUT`].
    async fn settle(&mut self) -> bool {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            let missing = unsettled(&self.cluster).await;
            if missing.is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                self.violation(
                    "settle",
                    format!(
                        "the cluster did not settle within {SETTLE_TIMEOUT:?}:\n      {}",
                        missing.join("\n      ")
                    ),
                );
                return false;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Two pods in [`FLOW_NAMESPACE`] on nodes 1 and 2, pinging each other
    /// (IPv4 one way, IPv6 the other) until the end.
    async fn start_flows(&mut self) {
        let one = self.cluster.add_pod(1, FLOW_NAMESPACE, "f1", &["app=flow"]).await;
        let two = self.cluster.add_pod(2, FLOW_NAMESPACE, "f2", &["app=flow"]).await;
        self.pod_addresses.extend(one.addrs());
        self.pod_addresses.extend(two.addrs());
        self.settle().await;
        self.flows = vec![
            Flow {
                what: format!("{} -> {} IPv4", one.name, two.name),
                pinger: Pinger::with_interval(one.netns.name(), two.ipv4.into(), FLOW_BATCH, FLOW_INTERVAL),
                lost_seen: 0,
            },
            Flow {
                what: format!("{} -> {} IPv6", two.name, one.name),
                pinger: Pinger::with_interval(two.netns.name(), one.ipv6.into(), FLOW_BATCH, FLOW_INTERVAL),
                lost_seen: 0,
            },
        ];
        self.flow_pods = vec![one, two];
        self.check_flows();
    }

    /// Each flow completes a run; a loss since the last look is a violation.
    fn check_flows(&mut self) {
        let mut lost = Vec::new();
        for flow in &mut self.flows {
            tokio::task::block_in_place(|| flow.pinger.wait_runs(1, FLOW_RUN_WITHIN));
            let totals = flow.pinger.totals();
            if totals.lost() > flow.lost_seen {
                lost.push(format!(
                    "{}: {} echo requests lost since the last look ({totals:?})",
                    flow.what,
                    totals.lost() - flow.lost_seen
                ));
                flow.lost_seen = totals.lost();
            }
        }
        for l in lost {
            self.violation("flow", l);
        }
    }

    fn stop_flows(&mut self) {
        self.check_flows();
        for flow in std::mem::take(&mut self.flows) {
            let totals = flow.pinger.stop();
            self.summary.flow_sent += totals.transmitted;
            self.summary.flow_lost += totals.lost();
            eprintln!("chaos: flow {}: {totals:?}", flow.what);
        }
    }

    /// No address held twice: among the pods rivet-cni reported, in each
    /// node's svc-ipam (and each pod's by its own container) and among each
    /// node's endpoints.
    async fn check_addresses(&mut self) {
        let mut problems = Vec::new();
        let mut holders: BTreeMap<IpAddr, Vec<String>> = BTreeMap::new();
        let pods: Vec<&ClusterPod> = self.live.iter().map(|l| &l.pod).chain(self.flow_pods.iter()).collect();
        for pod in &pods {
            for addr in pod.addrs() {
                holders
                    .entry(addr)
                    .or_default()
                    .push(format!("{}/{}", pod.namespace, pod.name));
            }
        }
        for (addr, who) in &holders {
            if who.len() > 1 {
                problems.push(format!("rivet-cni gave {addr} to {}", who.join(" and ")));
            }
        }
        for node in running(&self.cluster) {
            match allocations(node).await {
                Ok(allocations) => {
                    let mut owners: BTreeMap<IpAddr, Vec<String>> = BTreeMap::new();
                    for (addr, owner) in allocations {
                        owners.entry(addr).or_default().push(owner);
                    }
                    for (addr, who) in &owners {
                        if who.len() > 1 {
                            problems.push(format!(
                                "{}: svc-ipam holds {addr} for {}",
                                node.name,
                                who.join(" and ")
                            ));
                        }
                    }
                    for pod in pods.iter().filter(|p| p.node == node.index) {
                        for addr in pod.addrs() {
                            let held = owners.get(&addr).map(Vec::as_slice).unwrap_or_default();
                            if held != [format!("{}/eth0", pod.container_id)] {
                                problems.push(format!(
                                    "{}: svc-ipam holds {addr} of pod {}/{} (container {}) for {held:?}",
                                    node.name, pod.namespace, pod.name, pod.container_id
                                ));
                            }
                        }
                    }
                }
                Err(e) => problems.push(format!("{}: svc-ipam List: {e}", node.name)),
            }
            match endpoints(node).await {
                Ok(listing) => {
                    let mut by_addr: BTreeMap<IpAddr, Vec<String>> = BTreeMap::new();
                    for e in &listing.endpoints {
                        for a in &e.addresses {
                            if let Ok(addr) = rivet_proto::net::address_from_bytes(&a.address) {
                                by_addr
                                    .entry(addr)
                                    .or_default()
                                    .push(format!("endpoint {} ({}/{})", e.id, e.pod_namespace, e.pod_name));
                            }
                        }
                    }
                    for (addr, who) in &by_addr {
                        if who.len() > 1 {
                            problems.push(format!("{}: {addr} is the address of {}", node.name, who.join(" and ")));
                        }
                    }
                }
                Err(e) => problems.push(format!("{}: svc-endpoint ListEndpoints: {e}", node.name)),
            }
        }
        for p in problems {
            self.violation("addresses", p);
        }
    }

    /// A few random pairs of churned pods, each probed from one to the
    /// other against the oracle ([`allowed`]).
    async fn probe_matrix(&mut self) {
        if self.live.len() < 2 {
            return;
        }
        for _ in 0..self.options.probes_per_check {
            let (from, to) = self.pick_pair();
            let v6 = self.rng.below(2) == 1;
            let expect = allowed(&self.active, self.live[from].app, self.live[to].app);
            self.summary.probes += 1;
            if expect {
                self.summary.probes_allowed += 1;
            } else {
                self.summary.probes_denied += 1;
            }
            let started = Instant::now();
            loop {
                let (src, dst) = (&self.live[from].pod, &self.live[to].pod);
                let got = tokio::task::block_in_place(|| probe(src, dst, v6, expect));
                let wrong = match got {
                    Ok(reached) if reached == expect => break,
                    Ok(reached) => format!(
                        "{}/{} (app={}, node {}) -> {}/{} (app={}, node {}) {}: {} but the policies in force ({}) {}",
                        src.namespace,
                        src.name,
                        APPS[self.live[from].app],
                        src.node,
                        dst.namespace,
                        dst.name,
                        APPS[self.live[to].app],
                        dst.node,
                        if v6 { "IPv6" } else { "IPv4" },
                        if reached { "connected" } else { "got no echo" },
                        self.active.iter().map(PolicySpec::name).collect::<Vec<_>>().join(", "),
                        if expect { "allow it" } else { "deny it" },
                    ),
                    Err(e) => format!(
                        "probing {}/{} -> {}/{}: {e}",
                        src.namespace, src.name, dst.namespace, dst.name
                    ),
                };
                if started.elapsed() >= PROBE_CONVERGE {
                    self.violation("policy", format!("{wrong} (for {PROBE_CONVERGE:?})"));
                    break;
                }
                self.summary.probe_retries += 1;
                if !self.settle().await {
                    break;
                }
            }
        }
    }

    /// Two different churned pods, source and destination: half the time
    /// (with a policy in force) a destination one of the policies selects,
    /// so that refused pairs are probed as often as admitted ones.
    fn pick_pair(&mut self) -> (usize, usize) {
        let active: Vec<PolicySpec> = self.active.iter().copied().collect();
        if !active.is_empty() && self.rng.below(2) == 1 {
            let policy = *self.rng.choose(&active);
            let selected: Vec<usize> = (0..self.live.len())
                .filter(|&i| self.live[i].app == policy.to)
                .collect();
            if !selected.is_empty() {
                let to = *self.rng.choose(&selected);
                let mut from = self.rng.index(self.live.len() - 1);
                if from >= to {
                    from += 1;
                }
                return (from, to);
            }
        }
        let from = self.rng.index(self.live.len());
        let mut to = self.rng.index(self.live.len() - 1);
        if to >= from {
            to += 1;
        }
        (from, to)
    }

    /// Every churned and flow pod deleted (retried once settled), then
    /// every policy.
    async fn delete_everything(&mut self) {
        for live in std::mem::take(&mut self.live) {
            self.delete_pod(live).await;
        }
        for pod in std::mem::take(&mut self.flow_pods) {
            self.delete_pod(LivePod { pod, app: 0 }).await;
        }
        // Pods whose delete failed twice get a last try.
        for live in std::mem::take(&mut self.live) {
            if let Err(e) = self.cluster.try_delete_pod(&live.pod).await {
                self.violation(
                    "delete",
                    format!("{}/{} not deleted at the end: {e}", live.pod.namespace, live.pod.name),
                );
            }
        }
        for policy in std::mem::take(&mut self.active) {
            self.cluster.delete_policy(&policy.key()).await;
            self.summary.policies_deleted += 1;
        }
    }

    /// Waits until every node's [`inventory`] equals `baseline` again and
    /// no pod namespace is left; what still differs after [`END_TIMEOUT`]
    /// is a leak (or something lost).
    async fn wait_back_to(&mut self, baseline: &Inventory) {
        let deadline = Instant::now() + END_TIMEOUT;
        loop {
            let now = inventory(&self.cluster).await;
            let diff = difference(baseline, &now);
            if diff.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                for d in diff {
                    self.violation("leak", d);
                }
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// After two passes of each node's svc-gc that started once the pods
    /// were gone, no conntrack entry has an address of a deleted pod.
    async fn check_conntrack(&mut self, baseline: &Inventory) {
        let deleted_at = std::time::SystemTime::now();
        let deleted_nanos = deleted_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        // Addresses the nodes held before the run (health endpoints) are not
        // pods' of the run.
        let kept: BTreeSet<String> = baseline
            .iter()
            .filter(|(k, _)| k.ends_with(" ipam"))
            .flat_map(|(_, items)| {
                items
                    .iter()
                    .filter_map(|i| i.split_whitespace().next().map(String::from))
            })
            .collect();
        let gone: BTreeSet<IpAddr> = self
            .pod_addresses
            .iter()
            .filter(|a| !kept.contains(&a.to_string()))
            .copied()
            .collect();
        let mut problems = Vec::new();
        for node in running(&self.cluster) {
            problems.extend(conntrack_orphans(node, deleted_nanos, &gone).await);
        }
        for p in problems {
            self.violation("conntrack", p);
        }
    }
}

/// Waits for two passes of `node`'s svc-gc that started after
/// `deleted_nanos` with the orphan check done, then lists the conntrack
/// entries with an address in `gone`.
async fn conntrack_orphans(node: &ClusterNode, deleted_nanos: i64, gone: &BTreeSet<IpAddr>) -> Option<String> {
    let name = &node.name;
    // Two passes: the first may have listed the endpoints just before the
    // last delete.
    let deadline = Instant::now() + GC_MAX_INTERVAL * 4 + SETTLE_TIMEOUT;
    let mut seen = BTreeSet::new();
    let mut last_error = String::new();
    while seen.len() < 2 {
        match gc_status(node).await {
            Ok(status) => {
                if let Some(pass) = &status.last_pass
                    && pass.started_unix_nanos > deleted_nanos
                    && pass.orphan_check == gcpb::OrphanCheck::Done as i32
                {
                    seen.insert((status.boot_id.clone(), pass.pass_number));
                }
            }
            Err(e) => last_error = e,
        }
        if seen.len() < 2 && Instant::now() >= deadline {
            return Some(format!(
                "{name}: svc-gc made {} of 2 passes with the orphan check done after the deletes {last_error}",
                seen.len()
            ));
        }
        tokio::time::sleep(POLL).await;
    }
    let entries = match conntrack(node).await {
        Ok(entries) => entries,
        Err(e) => return Some(format!("{name}: DumpConntrack: {e}")),
    };
    let orphans: Vec<String> = entries
        .iter()
        .filter_map(|e| {
            let tuple = e.key.as_ref()?.tuple.as_ref()?;
            let src = rivet_proto::net::address_from_bytes(&tuple.source_address).ok()?;
            let dst = rivet_proto::net::address_from_bytes(&tuple.destination_address).ok()?;
            (gone.contains(&src) || gone.contains(&dst)).then(|| {
                format!(
                    "{src}:{} -> {dst}:{} (protocol {}, expires in {:?})",
                    tuple.source_port,
                    tuple.destination_port,
                    tuple.protocol,
                    Duration::from_nanos(e.expires_in_nanos.max(0) as u64)
                )
            })
        })
        .collect();
    (!orphans.is_empty()).then(|| {
        format!(
            "{name}: {} entries of deleted pods after two svc-gc passes, e.g. {}",
            orphans.len(),
            orphans.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
        )
    })
}

/// Copies every `*.log` under `from` to the same place under `to`; how many.
fn copy_logs(from: &Path, to: &Path) -> std::io::Result<usize> {
    let mut copied = 0;
    let mut stack = vec![from.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "log") {
                let target = to.join(path.strip_prefix(from).unwrap_or(&path));
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::copy(&path, &target)?;
                copied += 1;
            }
        }
    }
    Ok(copied)
}

/// The running nodes.
fn running(cluster: &Cluster) -> impl Iterator<Item = &ClusterNode> {
    cluster.nodes().iter().filter(|n| n.state == NodeState::Running)
}

/// A client channel that gives up quickly (a daemon may be restarting:
/// the caller looks again).
async fn channel(node: &ClusterNode, daemon: &str) -> Result<DaemonChannel, String> {
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    };
    connect_unix(&node.socket(daemon), &options)
        .await
        .map_err(|e| e.to_string())
}

/// svc-ipam's allocations of `node`: address and `container/interface`.
async fn allocations(node: &ClusterNode) -> Result<Vec<(IpAddr, String)>, String> {
    let listing = IpamClient::new(channel(node, "svc-ipam").await?)
        .list(ipampb::ListRequest {
            pool: String::new(),
            include_allocations: true,
        })
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    Ok(listing
        .pools
        .into_iter()
        .flat_map(|p| p.allocations)
        .chain(listing.orphaned)
        .filter_map(|a| {
            let addr = rivet_proto::net::address_from_bytes(&a.address).ok()?;
            let owner = a.owner.map(|o| format!("{}/{}", o.container_id, o.interface))?;
            Some((addr, owner))
        })
        .collect())
}

/// svc-endpoint's endpoints of `node`.
async fn endpoints(node: &ClusterNode) -> Result<eppb::ListEndpointsResponse, String> {
    Ok(EndpointServiceClient::new(channel(node, "svc-endpoint").await?)
        .list_endpoints(eppb::ListEndpointsRequest::default())
        .await
        .map_err(|e| e.to_string())?
        .into_inner())
}

/// svc-loader's endpoints of `node`.
async fn datapath_endpoints(node: &ClusterNode) -> Result<ldpb::ListEndpointsResponse, String> {
    Ok(
        rivet_proto::loader::v1::loader_service_client::LoaderServiceClient::new(channel(node, "svc-loader").await?)
            .list_endpoints(ldpb::ListEndpointsRequest {})
            .await
            .map_err(|e| e.to_string())?
            .into_inner(),
    )
}

/// svc-gc's status of `node`.
async fn gc_status(node: &ClusterNode) -> Result<gcpb::StatusResponse, String> {
    Ok(GcServiceClient::new(channel(node, "svc-gc").await?)
        .status(gcpb::StatusRequest {})
        .await
        .map_err(|e| e.to_string())?
        .into_inner())
}

/// Every conntrack entry of `node` (both families, every page).
async fn conntrack(node: &ClusterNode) -> Result<Vec<ldpb::ConntrackEntry>, String> {
    let mut client =
        rivet_proto::loader::v1::loader_service_client::LoaderServiceClient::new(channel(node, "svc-loader").await?);
    let mut entries: Vec<ldpb::ConntrackEntry> = Vec::new();
    let mut start_after = None;
    loop {
        let page = client
            .dump_conntrack(ldpb::DumpConntrackRequest {
                filter: None,
                page_size: 10_000,
                start_after: start_after.take(),
            })
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        start_after = page.entries.last().and_then(|e| e.key.clone());
        entries.extend(page.entries);
        if page.complete || start_after.is_none() {
            return Ok(entries);
        }
    }
}

/// What keeps the cluster from being settled, one line each: not
/// converged ([`Cluster::not_converged`]: peers, the other nodes' pods in
/// each ipcache), svc-endpoint still restoring or an endpoint not ready, a
/// daemon svc-endpoint drives not connected, or an endpoint whose identity
/// and policy revision the datapath does not hold yet.
pub async fn unsettled(cluster: &Cluster) -> Vec<String> {
    let mut missing = cluster.not_converged().await;
    for node in running(cluster) {
        let listing = match endpoints(node).await {
            Ok(l) => l,
            Err(e) => {
                missing.push(format!("{}: svc-endpoint ListEndpoints: {e}", node.name));
                continue;
            }
        };
        if !listing.restore_complete {
            missing.push(format!("{}: svc-endpoint is restoring", node.name));
        }
        let status = EndpointServiceClient::new(match channel(node, "svc-endpoint").await {
            Ok(c) => c,
            Err(e) => {
                missing.push(format!("{}: svc-endpoint: {e}", node.name));
                continue;
            }
        })
        .get_status(eppb::GetStatusRequest {})
        .await;
        match status {
            Ok(status) => {
                for d in status.into_inner().dependencies {
                    if !d.connected {
                        missing.push(format!("{}: svc-endpoint is not connected to {}", node.name, d.name));
                    }
                }
            }
            Err(e) => missing.push(format!("{}: svc-endpoint GetStatus: {e}", node.name)),
        }
        let datapath = match datapath_endpoints(node).await {
            Ok(d) => d,
            Err(e) => {
                missing.push(format!("{}: svc-loader ListEndpoints: {e}", node.name));
                continue;
            }
        };
        let held: BTreeMap<u32, &ldpb::Endpoint> = datapath.endpoints.iter().map(|e| (e.endpoint_id, e)).collect();
        for e in &listing.endpoints {
            if e.state != eppb::EndpointState::Ready as i32 {
                missing.push(format!(
                    "{}: endpoint {} ({}/{}) is {:?}",
                    node.name,
                    e.id,
                    e.pod_namespace,
                    e.pod_name,
                    eppb::EndpointState::try_from(e.state).unwrap_or_default()
                ));
                continue;
            }
            match held.get(&e.id) {
                Some(d) if d.identity == e.identity && d.policy_revision == e.policy_revision => {}
                Some(d) => missing.push(format!(
                    "{}: endpoint {} ({}/{}): the datapath holds identity {} revision {}, svc-endpoint realised {} revision {}",
                    node.name, e.id, e.pod_namespace, e.pod_name, d.identity, d.policy_revision, e.identity, e.policy_revision
                )),
                None => missing.push(format!(
                    "{}: endpoint {} ({}/{}) is not in the datapath",
                    node.name, e.id, e.pod_namespace, e.pod_name
                )),
            }
        }
    }
    missing
}

/// A TCP echo server on `dst` (both families, [`PROBE_PORT`]) while `src`
/// connects to it: whether the echo came back (expected allowed, within
/// [`ALLOWED_WITHIN`]) or a connection was made (expected denied, within
/// [`DENIED_WITHIN`]).
fn probe(src: &ClusterPod, dst: &ClusterPod, v6: bool, expect: bool) -> Result<bool, String> {
    let _server = dst
        .netns
        .tcp_echo_server(&[dst.socket_v4(PROBE_PORT), dst.socket_v6(PROBE_PORT)])
        .map_err(|e| format!("an echo server in {}/{}: {e}", dst.namespace, dst.name))?;
    let to = if v6 {
        dst.socket_v6(PROBE_PORT)
    } else {
        dst.socket_v4(PROBE_PORT)
    };
    let reached = if expect {
        src.netns.tcp_echo(to, ALLOWED_WITHIN)
    } else {
        src.netns.tcp_connect(to, DENIED_WITHIN)
    };
    reached.map_err(|e| format!("connecting from {}/{} to {to}: {e}", src.namespace, src.name))
}

/// What each running node holds now, by `"<node> <category>"`, plus the
/// cluster's pod namespaces and etcd keys (identity master keys aside).
pub async fn inventory(cluster: &Cluster) -> Inventory {
    let mut all = Inventory::new();
    for node in running(cluster) {
        let mut put = |category: &str, items: BTreeSet<String>| {
            all.insert(format!("{} {category}", node.name), items);
        };
        put(
            "ipam",
            match allocations(node).await {
                Ok(a) => a.into_iter().map(|(addr, owner)| format!("{addr} {owner}")).collect(),
                Err(e) => error_item(e),
            },
        );
        put(
            "endpoints",
            match endpoints(node).await {
                Ok(l) => l
                    .endpoints
                    .iter()
                    .map(|e| format!("{} {}/{} {}", e.id, e.pod_namespace, e.pod_name, e.host_interface))
                    .collect(),
                Err(e) => error_item(e),
            },
        );
        match datapath_endpoints(node).await {
            Ok(d) => {
                put(
                    "datapath endpoints",
                    d.endpoints
                        .iter()
                        .map(|e| {
                            format!(
                                "{} {} identity {} policy entries {}",
                                e.endpoint_id, e.host_ifname, e.identity, e.policy_entries
                            )
                        })
                        .collect(),
                );
                put(
                    "datapath orphans",
                    d.orphan_attachments
                        .iter()
                        .map(|o| format!("programs on {} without an endpoint", o.host_ifname))
                        .chain(
                            d.orphan_policy_endpoint_ids
                                .iter()
                                .map(|id| format!("policy entries of endpoint {id} without an endpoint")),
                        )
                        .collect(),
                );
            }
            Err(e) => put("datapath endpoints", error_item(e)),
        }
        put(
            "ipcache",
            match node.datapath_ipcache().await {
                Ok(entries) => entries
                    .iter()
                    .map(|e| {
                        format!(
                            "{} identity {} tunnel {}",
                            e.prefix
                                .as_ref()
                                .map(rivet_proto::net::format_prefix)
                                .unwrap_or_default(),
                            e.identity,
                            rivet_proto::net::format_address(&e.tunnel_endpoint)
                        )
                    })
                    .collect(),
                Err(e) => error_item(e.to_string()),
            },
        );
        put("policies", policies(node).await);
        put("identity references", identity_references(node).await);
        put("map entries", map_entries(node).await);
        put("links", links(node));
        put("tc filters", tc_filters(node));
        put("files", files(&node.state_dir));
    }
    let prefix = format!("{}{}-", rivet_cli::pod::POD_NETNS_PREFIX, cluster.name);
    all.insert(
        "pod namespaces".into(),
        match rivet_common::testing::netns::list_netns() {
            Ok(names) => names.into_iter().filter(|n| n.starts_with(&prefix)).collect(),
            Err(e) => error_item(e.to_string()),
        },
    );
    all.insert("etcd keys".into(), etcd_keys(&cluster.etcd_endpoint()).await);
    all
}

/// An inventory item saying the category could not be read (so it differs
/// from any real reading, and the wait goes on).
fn error_item(e: String) -> BTreeSet<String> {
    BTreeSet::from([format!("(unreadable: {e})")])
}

/// What `now` has that `baseline` has not ("left behind") and the reverse
/// ("gone"), one line per category and direction.
pub fn difference(baseline: &Inventory, now: &Inventory) -> Vec<String> {
    let empty = BTreeSet::new();
    let mut out = Vec::new();
    let categories: BTreeSet<&String> = baseline.keys().chain(now.keys()).collect();
    for category in categories {
        let before = baseline.get(category).unwrap_or(&empty);
        let after = now.get(category).unwrap_or(&empty);
        let left: Vec<&String> = after.difference(before).collect();
        let gone: Vec<&String> = before.difference(after).collect();
        if !left.is_empty() {
            out.push(format!("{category}: left behind: {}", join(&left)));
        }
        if !gone.is_empty() {
            out.push(format!("{category}: gone since the start: {}", join(&gone)));
        }
    }
    out
}

fn join(items: &[&String]) -> String {
    const SHOWN: usize = 8;
    let mut text = items
        .iter()
        .take(SHOWN)
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join("; ");
    if items.len() > SHOWN {
        text.push_str(&format!("; and {} more", items.len() - SHOWN));
    }
    text
}

/// The policies svc-endpoint holds.
async fn policies(node: &ClusterNode) -> BTreeSet<String> {
    let listed = async {
        rivet_proto::endpoint::v1::policy_service_client::PolicyServiceClient::new(channel(node, "svc-endpoint").await?)
            .list_policies(eppb::ListPoliciesRequest::default())
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    match listed {
        Ok(l) => l
            .into_inner()
            .policies
            .iter()
            .filter_map(|p| p.key.as_ref())
            .map(|k| format!("{}/{}/{}", k.kind, k.namespace, k.name))
            .collect(),
        Err(e) => error_item(e),
    }
}

/// svc-identity's identities with local references, with their owners.
async fn identity_references(node: &ClusterNode) -> BTreeSet<String> {
    let listed = async {
        IdentityServiceClient::new(channel(node, "svc-identity").await?)
            .list_identities(idpb::ListIdentitiesRequest {
                local_only: true,
                include_owners: true,
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    match listed {
        Ok(l) => l
            .into_inner()
            .identities
            .iter()
            .map(|i| {
                let mut owners = i.owners.clone();
                owners.sort();
                format!(
                    "{} [{}] {} references by {}",
                    i.id,
                    i.labels.join(","),
                    i.local_references,
                    owners.join(",")
                )
            })
            .collect(),
        Err(e) => error_item(e),
    }
}

/// Entry counts of the datapath's maps that hold per-endpoint, per-policy
/// or per-address state (not conntrack, NAT or counters, which traffic
/// changes; conntrack has its own check).
async fn map_entries(node: &ClusterNode) -> BTreeSet<String> {
    let status = async {
        rivet_proto::loader::v1::loader_service_client::LoaderServiceClient::new(channel(node, "svc-loader").await?)
            .get_datapath_status(ldpb::GetDatapathStatusRequest {})
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    match status {
        Ok(s) => s
            .into_inner()
            .maps
            .iter()
            .filter(|m| !(m.name.starts_with("ct") || m.name.starts_with("nat") || m.name.contains("metrics")))
            .filter_map(|m| Some(format!("{} {} entries", m.name, m.entries?)))
            .collect(),
        Err(e) => error_item(e),
    }
}

/// The node namespace's interfaces.
fn links(node: &ClusterNode) -> BTreeSet<String> {
    match node.netns.ip(&["-j", "link", "show"]) {
        Ok(out) => serde_json::from_str::<serde_json::Value>(&out)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|l| l["ifname"].as_str().map(String::from))
            .collect(),
        Err(e) => error_item(e.to_string()),
    }
}

/// The tc filters of every interface of the node namespace (kind and
/// program name; not the program ids, which a svc-loader restart may
/// change).
fn tc_filters(node: &ClusterNode) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for link in links(node) {
        for direction in ["ingress", "egress"] {
            let shown = node
                .netns
                .command("tc")
                .args(["-j", "filter", "show", "dev", &link, direction])
                .output();
            let Ok(shown) = shown else { continue };
            let filters: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap_or_default();
            for f in filters.as_array().into_iter().flatten() {
                if let Some(options) = f.get("options") {
                    out.insert(format!(
                        "{link} {direction} {} {}",
                        f["kind"].as_str().unwrap_or("?"),
                        options["bpf_name"].as_str().unwrap_or("")
                    ));
                }
            }
        }
    }
    out
}

/// What a node's state dir gains at its first pod or policy and keeps
/// (empty, or listing nothing: the "policies" inventory has their content).
const FIRST_USE: [&str; 2] = ["pods", "svc-endpoint/policies.json"];

/// Every file and directory under a node's state dir (logs and
/// [`FIRST_USE`] aside).
fn files(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let relative = path.strip_prefix(dir).unwrap_or(&path).display().to_string();
            if relative.ends_with(".log") || relative.contains(".log.") || FIRST_USE.contains(&relative.as_str()) {
                continue;
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            }
            out.insert(relative);
        }
    }
    out
}

/// Every key in the cluster's etcd but identity master keys
/// (`identities/v1/id/`), which only rivet-operator's GC removes.
async fn etcd_keys(endpoint: &str) -> BTreeSet<String> {
    let listed = async {
        let mut client = etcd_client::Client::connect([endpoint], None)
            .await
            .map_err(|e| e.to_string())?;
        client
            .get(
                "",
                Some(etcd_client::GetOptions::new().with_all_keys().with_keys_only()),
            )
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    match listed {
        Ok(response) => response
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .filter(|k| !k.contains("identities/v1/id/"))
            .collect(),
        Err(e) => error_item(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(policies: &[(bool, &str, &str)]) -> BTreeSet<PolicySpec> {
        let at = |app: &str| APPS.iter().position(|a| *a == app).unwrap();
        policies
            .iter()
            .map(|&(deny, to, from)| PolicySpec {
                deny,
                to: at(to),
                from: at(from),
            })
            .collect()
    }

    #[test]
    fn the_oracle_follows_networkpolicy_and_deny_rules() {
        let (a, b, c) = (0, 1, 2);
        // Nothing selects a pod: everything reaches it.
        assert!(allowed(&set(&[]), b, a));
        // An allow isolates its pods: only its peers get in.
        let allow_a_from_b = set(&[(false, "a", "b")]);
        assert!(allowed(&allow_a_from_b, b, a));
        assert!(!allowed(&allow_a_from_b, c, a));
        assert!(!allowed(&allow_a_from_b, a, a));
        assert!(allowed(&allow_a_from_b, c, b), "b is not selected");
        // Allows are a union.
        assert!(allowed(&set(&[(false, "a", "b"), (false, "a", "c")]), c, a));
        // A deny alone refuses only its peer (default deny off).
        let deny_a_from_b = set(&[(true, "a", "b")]);
        assert!(!allowed(&deny_a_from_b, b, a));
        assert!(allowed(&deny_a_from_b, c, a));
        // A deny wins over an allow of the same peer.
        assert!(!allowed(&set(&[(false, "a", "b"), (true, "a", "b")]), b, a));
        // With an allow and a deny of another peer, the allow still isolates.
        let both = set(&[(false, "a", "b"), (true, "a", "c")]);
        assert!(allowed(&both, b, a));
        assert!(!allowed(&both, c, a));
        assert!(!allowed(&both, 3, a));
    }

    #[test]
    fn policies_parse_and_have_distinct_keys() {
        let all = PolicySpec::all();
        assert_eq!(all.len(), 2 * APPS.len() * APPS.len());
        let keys: BTreeSet<String> = all.iter().map(PolicySpec::key).collect();
        assert_eq!(keys.len(), all.len());
        for p in &all {
            let parsed = rivet_policy::Policy::parse(&p.yaml());
            assert!(parsed.is_ok(), "{}: {parsed:?}\n{}", p.name(), p.yaml());
        }
    }

    #[test]
    fn the_rng_is_splitmix64() {
        // The reference implementation's first outputs for seed 0.
        let mut rng = ChaosRng::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        let mut rng = ChaosRng::new(42);
        for _ in 0..1000 {
            assert!(rng.below(3) < 3);
        }
    }

    /// Played with every add succeeding: a long run fills up to its 200 pods
    /// within the steps a 30-minute run makes (about 1,800; 600 in 10
    /// minutes), while the suite's 30-pod run keeps its unbiased weights.
    #[test]
    fn a_long_run_fills_toward_its_max_and_a_small_one_keeps_its_weights() {
        let play = |seed: u64, max: usize, steps: u64| {
            let mut rng = ChaosRng::new(seed);
            let (mut live, mut full_at) = (0usize, None);
            for step in 0..steps {
                match choose_action(&mut rng, live, max, 0, 32) {
                    Action::Add | Action::KillDuringAdd => live += 1,
                    Action::Delete => live -= 1,
                    _ => {}
                }
                if live == max && full_at.is_none() {
                    full_at = Some(step);
                }
            }
            full_at
        };
        for seed in 0..5 {
            let full_at = play(seed, 200, 1_800);
            assert!(
                full_at.is_some_and(|s| s < 1_200),
                "seed {seed}: 200 live pods only at step {full_at:?}"
            );
        }
        for live in 0..30 {
            assert_eq!(add_weight(live, 30), 30, "no bias at the suite's 30 pods");
        }
        assert_eq!(add_weight(0, 200), 90);
        assert_eq!(add_weight(100, 200), 60);
        assert_eq!(add_weight(199, 200), 30);
    }

    #[test]
    fn a_seed_makes_the_same_choices() {
        let choices = |seed| {
            let mut rng = ChaosRng::new(seed);
            (0..50)
                .map(|i| choose_action(&mut rng, 4 + i % 7, 8, i % 3, 32))
                .collect::<Vec<_>>()
        };
        assert_eq!(choices(7), choices(7));
        assert_ne!(choices(7), choices(8));
        let mut rng = ChaosRng::new(1);
        assert_eq!(
            choose_action(&mut rng, 0, 8, 0, 32),
            Action::Add,
            "below the minimum: an add"
        );
        for _ in 0..100 {
            let a = choose_action(&mut rng, 8, 8, 0, 32);
            assert!(
                !matches!(a, Action::Add | Action::KillDuringAdd | Action::DeletePolicy),
                "full and no policy: {a:?}"
            );
        }
    }
}
