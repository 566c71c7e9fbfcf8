//! `cluster` (issue 18 §5): pods of a Deployment until Running on a real
//! kubelet cluster, Rivet against the reference `bridge` + `host-local`
//! plugins on the same cluster in the same run.
//!
//! One `rivet_e2e::kube_cluster::KubeCluster` (control plane, two kubelet +
//! containerd workers, `--cni none`) with the Rivet image imported gets
//! Rivet from `kubectl apply -k deploy/` (deploy/ as of the image's git
//! revision, the archive's tag set by a kustomization of its own). Every worker's containerd also has the runtime
//! handler `reference-bridge`, whose CNI config is the reference bridge +
//! host-local conflist; a RuntimeClass of that name puts a pod on it. So
//! both sides run on the same kubelets, containerd, scheduler and API
//! server, and a pod differs only by its `runtimeClassName`.
//!
//! A round applies a Deployment of `--replicas` pause pods (spread evenly
//! over the workers, `maxSkew: 1`) and times it until every pod is Running
//! with an address (a pod watch started before the apply), checks each
//! address is of its side's network on its node, counts the sandboxes the
//! kubelets failed to create and retried (their `FailedCreatePodSandBox`
//! events), deletes the Deployment and waits until every pod is gone. Rounds alternate the sides, the order
//! flipping every round, after one untimed warm-up round each; ratio =
//! median of per-round Rivet / bridge times (lower is better, goal ≤ 1.2).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, Event};
use rivet_e2e::image::PAUSE_IMAGE;
use rivet_e2e::kube_cluster::{KubeCluster, KubeClusterOptions, REFERENCE_BRIDGE_HANDLER, WorkerCni};
use rivet_k8s::{NOT_READY_TAINT, RivetNode, is_not_ready_taint};

use crate::report::{self, BenchResult, Spread};

/// The namespace of the measured Deployments (its ServiceAccount exists
/// from the start, so no pod waits for one).
const NAMESPACE: &str = "default";
/// The Rivet image's name (`cargo xtask image`).
const RIVET_IMAGE: &str = "docker.io/rivet/rivet";
/// How long Rivet may take to be ready on every node after the apply.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(300);
/// The server-side apply field manager.
const FIELD_MANAGER: &str = "rivet-bench";

/// Arguments of `rivet-bench cluster`.
#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// The Rivet image: an OCI archive `cargo xtask image` wrote
    /// (`rivet-<tag>.oci.tar`; `--profile release` for figures of record).
    #[arg(long, value_name = "ARCHIVE")]
    image: PathBuf,
    /// Pods of each round's Deployment.
    #[arg(long, default_value_t = 100)]
    replicas: u32,
    /// Timed rounds per side.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Pods of the untimed warm-up round each side runs first (0: none).
    #[arg(long, default_value_t = 10)]
    warmup_replicas: u32,
    /// Workers of the cluster.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// How long one round may take until every pod is Running, and again
    /// until every pod is gone.
    #[arg(long, default_value_t = 600)]
    timeout_seconds: u64,
}

/// The two networks compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Rivet (the node's CNI, from deploy/).
    Rivet,
    /// The reference bridge + host-local plugins (RuntimeClass `reference-bridge`).
    Bridge,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Rivet => "rivet",
            Side::Bridge => "bridge",
        }
    }
}

/// The sides of round `round`: Rivet first in even rounds, the bridge in odd ones.
fn round_order(round: usize) -> [Side; 2] {
    if round.is_multiple_of(2) {
        [Side::Rivet, Side::Bridge]
    } else {
        [Side::Bridge, Side::Rivet]
    }
}

/// `<dir>/rivet-<tag>.oci.tar` → `<tag>`.
fn image_tag(archive: &Path) -> anyhow::Result<String> {
    let name = archive
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("the image archive {} has no file name", archive.display()))?;
    let tag = name
        .strip_prefix("rivet-")
        .and_then(|rest| rest.strip_suffix(".oci.tar"))
        .filter(|tag| !tag.is_empty())
        .with_context(|| {
            format!(
                "the image archive {} is not named rivet-<tag>.oci.tar (cargo xtask image writes it so)",
                archive.display()
            )
        })?;
    Ok(tag.to_owned())
}

/// deploy/ as of the image's revision: `git archive <tag> deploy` unpacked
/// into `dir` when the tag names a commit of this checkout (the manifests
/// must be the ones that image was built with: a later deploy/ may run a
/// command an older image lacks); else (`-dirty`, another tag) the
/// checkout's own deploy/. Returns the absolute path.
fn deploy_of_revision(tag: &str, dir: &Path) -> anyhow::Result<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .current_dir(&workspace)
            .args(args)
            .output()
            .with_context(|| format!("running git {args:?}"))
    };
    let commit = format!("{tag}^{{commit}}");
    if git(&["rev-parse", "--verify", "--quiet", &commit])?.status.success() {
        let archive = dir.join("deploy.tar");
        let out = git(&[
            "archive",
            "--format=tar",
            "-o",
            &archive.display().to_string(),
            tag,
            "deploy",
        ])?;
        ensure!(
            out.status.success(),
            "git archive {tag} deploy: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = std::process::Command::new("tar")
            .arg("-xf")
            .arg(&archive)
            .arg("-C")
            .arg(dir)
            .output()
            .context("running tar")?;
        ensure!(
            out.status.success(),
            "unpacking {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("deploy/ as of {tag} (the image's revision)");
        return Ok(dir.join("deploy"));
    }
    let deploy = workspace.join("deploy");
    println!("deploy/ of this checkout ({tag} names no commit here)");
    deploy
        .canonicalize()
        .with_context(|| format!("finding deploy/ at {}", deploy.display()))
}

/// `target` (absolute) as a path relative to the absolute dir `from`:
/// kustomize takes no absolute resource paths.
fn relative_to(target: &Path, from: &Path) -> PathBuf {
    let mut path: PathBuf = from.components().skip(1).map(|_| "..").collect();
    path.push(target.strip_prefix("/").unwrap_or(target));
    path
}

/// The kustomization that installs deploy/ with the image tag `tag`.
fn kustomization(deploy: &Path, tag: &str) -> String {
    format!(
        "# Written by rivet-bench cluster: deploy/ with the benchmarked image.\n\
         apiVersion: kustomize.config.k8s.io/v1beta1\n\
         kind: Kustomization\n\
         resources:\n\
         - {deploy}\n\
         images:\n\
         - name: {RIVET_IMAGE}\n  newTag: \"{tag}\"\n",
        deploy = deploy.display()
    )
}

/// The measured Deployment: `replicas` pause pods of `side`, spread evenly
/// over the nodes.
fn deployment(side: Side, replicas: u32) -> anyhow::Result<Deployment> {
    let name = deployment_name(side);
    let mut pod_spec = serde_json::json!({
        // Not 0: a pod deleted with grace 0 leaves the API at once, before
        // its node stopped it; with 1 it goes when the kubelet is done (the
        // pause process exits on SIGTERM at once).
        "terminationGracePeriodSeconds": 1,
        // The network's cost, not a token's projection.
        "automountServiceAccountToken": false,
        "enableServiceLinks": false,
        "topologySpreadConstraints": [{
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": { "matchLabels": { "app": name } }
        }],
        "containers": [{ "name": "pause", "image": PAUSE_IMAGE, "imagePullPolicy": "Never" }]
    });
    if side == Side::Bridge {
        pod_spec["runtimeClassName"] = REFERENCE_BRIDGE_HANDLER.into();
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": name, "namespace": NAMESPACE },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": { "metadata": { "labels": { "app": name } }, "spec": pod_spec }
        }
    }))
    .context("building the benchmark Deployment")
}

fn deployment_name(side: Side) -> String {
    format!("bench-{}", side.name())
}

/// What a pod of a round looks like in the watch.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodState {
    running: bool,
    node: Option<String>,
    ip: Option<String>,
}

impl PodState {
    fn of(pod: &Pod) -> Self {
        let status = pod.status.as_ref();
        let ip = status.and_then(|s| s.pod_ip.clone());
        Self {
            running: pod.metadata.deletion_timestamp.is_none()
                && status.and_then(|s| s.phase.as_deref()) == Some("Running")
                && ip.is_some(),
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            ip,
        }
    }
}

/// The pods of one Deployment, as a watch keeps them.
#[derive(Debug, Default)]
struct PodTable {
    pods: BTreeMap<String, PodState>,
    /// A re-list in progress (the watch restarted).
    relisting: Option<BTreeMap<String, PodState>>,
}

impl PodTable {
    fn apply(&mut self, event: Event<Pod>) {
        let name = |pod: &Pod| pod.metadata.name.clone().unwrap_or_default();
        match event {
            Event::Apply(pod) => {
                self.pods.insert(name(&pod), PodState::of(&pod));
            }
            Event::Delete(pod) => {
                self.pods.remove(&name(&pod));
            }
            Event::Init => self.relisting = Some(BTreeMap::new()),
            Event::InitApply(pod) => {
                self.relisting
                    .get_or_insert_with(BTreeMap::new)
                    .insert(name(&pod), PodState::of(&pod));
            }
            Event::InitDone => {
                if let Some(pods) = self.relisting.take() {
                    self.pods = pods;
                }
            }
        }
    }

    fn running(&self) -> usize {
        self.pods.values().filter(|p| p.running).count()
    }

    /// Pods by phase for an error message.
    fn summary(&self) -> String {
        format!("{} pods, {} Running", self.pods.len(), self.running())
    }
}

/// One side's timed round.
#[derive(Debug, Clone, Copy)]
struct RoundFigures {
    /// Apply to every pod Running.
    running: Duration,
    /// Apply to the first pod Running.
    first: Duration,
    /// Delete to every pod gone.
    gone: Duration,
    /// Sandboxes the kubelet failed to create (and retried) for the round's
    /// pods, from its `FailedCreatePodSandBox` events (a failed CNI ADD).
    failed_sandboxes: u32,
}

/// The cluster with Rivet installed and the bridge's RuntimeClass.
struct Bench {
    cluster: KubeCluster,
    /// Each node's pod CIDRs of `side`.
    networks: BTreeMap<String, (Vec<IpNet>, Vec<IpNet>)>,
}

impl Bench {
    async fn start(args: &ClusterArgs, tag: &str) -> anyhow::Result<(Self, Duration)> {
        let cluster = KubeCluster::start(KubeClusterOptions {
            workers: args.workers,
            cni: WorkerCni::None,
            images: vec![args.image.clone()],
            reference_bridge_handler: true,
            ..KubeClusterOptions::default()
        })
        .await
        .context("starting the Kubernetes cluster")?;
        println!(
            "cluster {} up in {:.1} s ({} workers, no CNI yet)",
            cluster.name(),
            cluster.started_in().as_secs_f64(),
            args.workers
        );
        let mut bench = Self {
            cluster,
            networks: BTreeMap::new(),
        };
        let installed = bench.install_rivet(tag).await?;
        bench.networks = bench.node_networks().await?;
        let runtime_classes: Api<RuntimeClass> = Api::all(bench.cluster.admin_client());
        let runtime_class: RuntimeClass = serde_json::from_value(serde_json::json!({
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": { "name": REFERENCE_BRIDGE_HANDLER },
            "handler": REFERENCE_BRIDGE_HANDLER
        }))?;
        runtime_classes
            .create(&PostParams::default(), &runtime_class)
            .await
            .context("creating the reference bridge's RuntimeClass")?;
        Ok((bench, installed))
    }

    /// `kubectl apply -k` of deploy/ with the image's tag; waits until the
    /// DaemonSet is Ready on every node and every Node is Ready. Returns the
    /// time that took.
    async fn install_rivet(&mut self, tag: &str) -> anyhow::Result<Duration> {
        let dir = tempfile::Builder::new().prefix("rivet-bench-cluster-").tempdir()?;
        let deploy = deploy_of_revision(tag, dir.path())?;
        std::fs::write(
            dir.path().join("kustomization.yaml"),
            kustomization(&relative_to(&deploy, dir.path()), tag),
        )?;
        let started = Instant::now();
        let out = self
            .cluster
            .kubectl()?
            .arg("apply")
            .arg("-k")
            .arg(dir.path())
            .output()
            .context("running kubectl apply -k")?;
        ensure!(
            out.status.success(),
            "kubectl apply -k deploy/ (tag {tag}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let workers = self.cluster.workers().len() as i32;
        let daemon_sets: Api<DaemonSet> = Api::namespaced(self.cluster.admin_client(), "kube-system");
        let ready = kube::runtime::wait::await_condition(daemon_sets, "rivet-node", move |ds: Option<&DaemonSet>| {
            ds.and_then(|ds| ds.status.as_ref())
                .is_some_and(|s| s.desired_number_scheduled == workers && s.number_ready == workers)
        });
        tokio::time::timeout(INSTALL_TIMEOUT, ready)
            .await
            .with_context(|| format!("DaemonSet rivet-node not Ready on {workers} nodes within {INSTALL_TIMEOUT:?}"))?
            .context("watching DaemonSet rivet-node")?;
        self.cluster
            .wait_nodes_ready(INSTALL_TIMEOUT)
            .await
            .context("waiting for the Nodes to be Ready on Rivet")?;
        // Pods are scheduled once svc-k8s-sync lifted Rivet's not-ready taint.
        let nodes: Api<Node> = Api::all(self.cluster.admin_client());
        for worker in self.cluster.workers() {
            let untainted = kube::runtime::wait::await_condition(nodes.clone(), &worker.name, |node: Option<&Node>| {
                node.is_some_and(|n| {
                    let taints = n.spec.as_ref().and_then(|s| s.taints.as_deref()).unwrap_or_default();
                    !taints.iter().any(is_not_ready_taint)
                })
            });
            tokio::time::timeout(INSTALL_TIMEOUT, untainted)
                .await
                .with_context(|| format!("Node {} still tainted {NOT_READY_TAINT}", worker.name))?
                .context("watching the Nodes")?;
        }
        let took = started.elapsed();
        println!(
            "rivet {tag} installed: DaemonSet Ready on {workers} nodes, Nodes Ready, {:.1} s after kubectl apply -k",
            took.as_secs_f64()
        );
        Ok(took)
    }

    /// Each node's pod networks: Rivet's (its RivetNode's pod CIDRs, from
    /// the operator) and the reference bridge's (its worker's).
    async fn node_networks(&self) -> anyhow::Result<BTreeMap<String, (Vec<IpNet>, Vec<IpNet>)>> {
        let nodes: Api<RivetNode> = Api::all(self.cluster.admin_client());
        let mut networks = BTreeMap::new();
        for worker in self.cluster.workers() {
            let node = nodes.get(&worker.name).await.context("reading a RivetNode")?;
            let rivet: Vec<IpNet> = node
                .spec
                .pod_cidrs
                .iter()
                .map(|c| c.parse().with_context(|| format!("Node {} pod CIDR {c}", worker.name)))
                .collect::<anyhow::Result<_>>()?;
            ensure!(!rivet.is_empty(), "RivetNode {} has no pod CIDR", worker.name);
            let bridge: IpNet = worker.pod_cidr.parse()?;
            networks.insert(worker.name.clone(), (rivet, vec![bridge]));
        }
        Ok(networks)
    }

    /// Every pod's address is of `side`'s network on its node, and the pods
    /// are on every node.
    fn check_addresses(&self, side: Side, table: &PodTable) -> anyhow::Result<BTreeMap<String, usize>> {
        let mut per_node = BTreeMap::new();
        for (name, pod) in &table.pods {
            let node = pod.node.as_deref().with_context(|| format!("pod {name} has no node"))?;
            let ip: std::net::IpAddr = pod
                .ip
                .as_deref()
                .with_context(|| format!("pod {name} has no address"))?
                .parse()
                .with_context(|| format!("pod {name}'s address"))?;
            let (rivet, bridge) = self
                .networks
                .get(node)
                .with_context(|| format!("pod {name} on unknown node {node}"))?;
            let expected = match side {
                Side::Rivet => rivet,
                Side::Bridge => bridge,
            };
            ensure!(
                expected.iter().any(|net| net.contains(&ip)),
                "{} pod {name} on {node} has {ip}, outside its network {expected:?}",
                side.name()
            );
            *per_node.entry(node.to_owned()).or_insert(0) += 1;
        }
        ensure!(
            per_node.len() == self.networks.len(),
            "{} pods on {per_node:?}, not on every node",
            side.name()
        );
        Ok(per_node)
    }

    /// Applies `side`'s Deployment of `replicas` pods, times it until all
    /// are Running, then deletes it and times it until all are gone.
    async fn round(&mut self, side: Side, replicas: u32, timeout: Duration) -> anyhow::Result<RoundFigures> {
        let client = self.cluster.admin_client();
        let name = deployment_name(side);
        let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
        let deployments: Api<Deployment> = Api::namespaced(client, NAMESPACE);
        let mut watch = watcher::watcher(pods, watcher::Config::default().labels(&format!("app={name}"))).boxed();
        let mut table = PodTable::default();
        // The watch's first list, before the apply: no event is missed.
        initial_list(&mut watch, &mut table).await?;
        ensure!(
            table.pods.is_empty(),
            "pods of {name} left from before: {}",
            table.summary()
        );

        let started = Instant::now();
        deployments
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(&deployment(side, replicas)?),
            )
            .await
            .with_context(|| format!("applying Deployment {name}"))?;
        let mut first = None;
        let wanted = replicas as usize;
        let deadline = started + timeout;
        while table.running() < wanted {
            next_event(
                &mut watch,
                &mut table,
                deadline,
                &format!("{wanted} pods of {name} Running"),
            )
            .await?;
            if first.is_none() && table.running() > 0 {
                first = Some(started.elapsed());
            }
        }
        let running = started.elapsed();
        let per_node = self.check_addresses(side, &table)?;
        let failed_sandboxes = failed_sandboxes(&self.cluster.admin_client(), &table).await?;
        self.cluster.check_running().context("the cluster after a round")?;

        let deleting = Instant::now();
        deployments
            .delete(&name, &DeleteParams::background())
            .await
            .with_context(|| format!("deleting Deployment {name}"))?;
        let deadline = deleting + timeout;
        while !table.pods.is_empty() {
            next_event(&mut watch, &mut table, deadline, &format!("every pod of {name} gone")).await?;
        }
        let figures = RoundFigures {
            running,
            first: first.unwrap_or(running),
            gone: deleting.elapsed(),
            failed_sandboxes,
        };
        println!(
            "  {:<6} {replicas} pods Running in {:.2} s ({:.1} pods/s, first {:.2} s; {per_node:?}; {} failed \
             sandboxes retried), gone {:.2} s after the delete",
            side.name(),
            figures.running.as_secs_f64(),
            f64::from(replicas) / figures.running.as_secs_f64(),
            figures.first.as_secs_f64(),
            figures.failed_sandboxes,
            figures.gone.as_secs_f64()
        );
        Ok(figures)
    }
}

/// The kubelets' `FailedCreatePodSandBox` events for the pods of `table`
/// (each event's count: the kubelet folds repeats into one), as posted by now.
async fn failed_sandboxes(client: &kube::Client, table: &PodTable) -> anyhow::Result<u32> {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), NAMESPACE);
    let listed = events
        .list(&kube::api::ListParams::default().fields("reason=FailedCreatePodSandBox"))
        .await
        .context("listing the FailedCreatePodSandBox events")?;
    Ok(listed
        .items
        .iter()
        .filter(|e| {
            e.involved_object
                .name
                .as_ref()
                .is_some_and(|name| table.pods.contains_key(name))
        })
        .map(|e| e.count.map_or(1, |c| c.max(1) as u32))
        .sum())
}

type PodWatch = futures::stream::BoxStream<'static, Result<Event<Pod>, watcher::Error>>;

/// Feeds the watch's events into `table` until its first list is done.
async fn initial_list(watch: &mut PodWatch, table: &mut PodTable) -> anyhow::Result<()> {
    loop {
        let event = watch
            .try_next()
            .await
            .context("watching the benchmark's pods")?
            .context("the pod watch ended")?;
        let done = matches!(event, Event::InitDone);
        table.apply(event);
        if done {
            return Ok(());
        }
    }
}

/// Feeds the watch's next event into `table`, failing past `deadline`.
async fn next_event(watch: &mut PodWatch, table: &mut PodTable, deadline: Instant, what: &str) -> anyhow::Result<()> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(remaining, watch.try_next()).await {
        Ok(Ok(Some(event))) => {
            table.apply(event);
            Ok(())
        }
        Ok(Ok(None)) => bail!("the pod watch ended while waiting for {what}"),
        // A watch error is retried by the next poll (the watcher re-lists).
        Ok(Err(e)) => {
            eprintln!("pod watch: {e} (re-listing)");
            Ok(())
        }
        Err(_) => bail!("not {what} in time: {}", table.summary()),
    }
}

/// The bench.
pub async fn run(args: &ClusterArgs) -> anyhow::Result<BenchResult> {
    ensure!(
        args.rounds > 0 && args.replicas > 0,
        "--rounds and --replicas must be at least 1"
    );
    let tag = image_tag(&args.image)?;
    let archive_bytes = std::fs::metadata(&args.image)
        .with_context(|| format!("reading the image archive {}", args.image.display()))?
        .len();
    println!(
        "image {RIVET_IMAGE}:{tag} ({}, {:.1} MiB)",
        args.image.display(),
        archive_bytes as f64 / (1024.0 * 1024.0)
    );
    let (mut bench, installed) = Bench::start(args, &tag).await?;
    let timeout = Duration::from_secs(args.timeout_seconds);
    if args.warmup_replicas > 0 {
        println!("warm-up ({} pods each, not counted)", args.warmup_replicas);
        for side in round_order(0) {
            bench.round(side, args.warmup_replicas, timeout).await?;
        }
    }
    let load_before = report::load_average()?;
    let mut rivet = Vec::new();
    let mut bridge = Vec::new();
    for round in 0..args.rounds {
        println!("round {}/{}", round + 1, args.rounds);
        for side in round_order(round) {
            let figures = bench.round(side, args.replicas, timeout).await?;
            match side {
                Side::Rivet => rivet.push(figures),
                Side::Bridge => bridge.push(figures),
            }
        }
    }
    let load_after = report::load_average()?;
    let started_in = bench.cluster.started_in();
    drop(bench);

    let secs = |rounds: &[RoundFigures], f: fn(&RoundFigures) -> Duration| {
        Spread::of(rounds.iter().map(|r| f(r).as_secs_f64()).collect())
    };
    let rate = |rounds: &[RoundFigures]| {
        Spread::of(
            rounds
                .iter()
                .map(|r| f64::from(args.replicas) / r.running.as_secs_f64())
                .collect(),
        )
    };
    let failures = |rounds: &[RoundFigures]| Spread::of(rounds.iter().map(|r| f64::from(r.failed_sandboxes)).collect());
    let ratios = Spread::of(
        rivet
            .iter()
            .zip(&bridge)
            .map(|(r, b)| r.running.as_secs_f64() / b.running.as_secs_f64())
            .collect(),
    );
    let (rivet_s, bridge_s) = (secs(&rivet, |r| r.running), secs(&bridge, |r| r.running));
    println!(
        "{} pods Running: rivet {:.2} s (min {:.2}, max {:.2}), bridge {:.2} s (min {:.2}, max {:.2}); \
         rivet / bridge {:.3} (min {:.3}, max {:.3}, goal <= 1.2); load {load_before:.2} -> {load_after:.2}",
        args.replicas,
        rivet_s.median,
        rivet_s.min,
        rivet_s.max,
        bridge_s.median,
        bridge_s.min,
        bridge_s.max,
        ratios.median,
        ratios.min,
        ratios.max
    );
    let metrics = vec![
        ("replicas".into(), f64::from(args.replicas)),
        ("rounds".into(), args.rounds as f64),
        ("rivet_running_s".into(), rivet_s.median),
        ("bridge_running_s".into(), bridge_s.median),
        ("rivet_pods_per_s".into(), rate(&rivet).median),
        ("bridge_pods_per_s".into(), rate(&bridge).median),
        ("rivet_first_running_s".into(), secs(&rivet, |r| r.first).median),
        ("bridge_first_running_s".into(), secs(&bridge, |r| r.first).median),
        ("rivet_failed_sandboxes".into(), failures(&rivet).median),
        ("bridge_failed_sandboxes".into(), failures(&bridge).median),
        ("rivet_gone_s".into(), secs(&rivet, |r| r.gone).median),
        ("bridge_gone_s".into(), secs(&bridge, |r| r.gone).median),
        ("ratio_min".into(), ratios.min),
        ("ratio_max".into(), ratios.max),
        ("cluster_start_s".into(), started_in.as_secs_f64()),
        ("rivet_install_s".into(), installed.as_secs_f64()),
        ("image_archive_mib".into(), archive_bytes as f64 / (1024.0 * 1024.0)),
        ("load_before".into(), load_before),
        ("load_after".into(), load_after),
    ];
    Ok(BenchResult {
        name: "cluster".into(),
        metrics,
        ratio: ratios.median,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tag_comes_from_the_archive_name() {
        assert_eq!(
            image_tag(Path::new("target/images/rivet-1a2b3c4.oci.tar")).unwrap(),
            "1a2b3c4"
        );
        assert_eq!(
            image_tag(Path::new("/x/rivet-1a2b-dirty.oci.tar")).unwrap(),
            "1a2b-dirty"
        );
        for bad in ["target/images/pause-1a2b.oci.tar", "rivet-.oci.tar", "rivet-1a2b.tar"] {
            let err = image_tag(Path::new(bad)).unwrap_err().to_string();
            assert!(err.contains("rivet-<tag>.oci.tar"), "{bad}: {err}");
        }
    }

    #[test]
    fn rounds_alternate_and_flip() {
        assert_eq!(round_order(0), [Side::Rivet, Side::Bridge]);
        assert_eq!(round_order(1), [Side::Bridge, Side::Rivet]);
        assert_eq!(round_order(2), round_order(0));
    }

    #[test]
    fn only_the_bridge_side_names_the_runtime_class() {
        let bridge = deployment(Side::Bridge, 100).unwrap();
        let spec = bridge.spec.unwrap();
        assert_eq!(spec.replicas, Some(100));
        let pod = spec.template.spec.unwrap();
        assert_eq!(pod.runtime_class_name.as_deref(), Some(REFERENCE_BRIDGE_HANDLER));
        let spread = &pod.topology_spread_constraints.unwrap()[0];
        assert_eq!(
            (spread.max_skew, spread.when_unsatisfiable.as_str()),
            (1, "DoNotSchedule")
        );
        let rivet = deployment(Side::Rivet, 10)
            .unwrap()
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        assert_eq!(rivet.runtime_class_name, None);
    }

    #[test]
    fn deploy_comes_from_the_image_s_revision() {
        let dir = tempfile::tempdir().unwrap();
        let head = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let head = String::from_utf8(head.stdout).unwrap().trim().to_owned();
        let deploy = deploy_of_revision(&head, dir.path()).unwrap();
        assert_eq!(deploy, dir.path().join("deploy"));
        assert!(deploy.join("kustomization.yaml").exists());
        // A dirty tag names no commit: this checkout's deploy/.
        let other = tempfile::tempdir().unwrap();
        let deploy = deploy_of_revision(&format!("{head}-dirty"), other.path()).unwrap();
        assert!(
            deploy.ends_with("deploy") && !deploy.starts_with(other.path()),
            "{}",
            deploy.display()
        );
    }

    #[test]
    fn deploy_is_named_relative_to_the_kustomization() {
        assert_eq!(
            relative_to(Path::new("/w/x/deploy"), Path::new("/tmp/k")),
            Path::new("../../w/x/deploy")
        );
    }

    #[test]
    fn the_kustomization_sets_the_tag_on_deploy() {
        let text = kustomization(Path::new("/w/deploy"), "1a2b3c4");
        assert!(text.contains("- /w/deploy\n"), "{text}");
        assert!(
            text.contains("- name: docker.io/rivet/rivet\n  newTag: \"1a2b3c4\"\n"),
            "{text}"
        );
    }

    #[test]
    fn the_table_counts_running_pods_and_follows_a_relist() {
        let pod = |name: &str, phase: &str, ip: Option<&str>| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": { "name": name },
                "spec": { "nodeName": "n1", "containers": [] },
                "status": { "phase": phase, "podIP": ip }
            }))
            .unwrap()
        };
        let mut table = PodTable::default();
        table.apply(Event::Apply(pod("a", "Pending", None)));
        table.apply(Event::Apply(pod("b", "Running", Some("198.18.64.2"))));
        // Running without an address yet does not count.
        table.apply(Event::Apply(pod("c", "Running", None)));
        assert_eq!((table.pods.len(), table.running()), (3, 1));
        table.apply(Event::Init);
        table.apply(Event::InitApply(pod("a", "Running", Some("198.18.64.3"))));
        assert_eq!(table.pods.len(), 3, "the old view stays until the list is done");
        table.apply(Event::InitDone);
        assert_eq!((table.pods.len(), table.running()), (1, 1));
        table.apply(Event::Delete(pod("a", "Running", Some("198.18.64.3"))));
        assert!(table.pods.is_empty());
    }
}
