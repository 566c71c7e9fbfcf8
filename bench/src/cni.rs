//! `cni`: the real rivet-cni binary on one simulated node with every daemon
//! real (svc-loader in the node namespace, svc-identity with its embedded
//! store, svc-ipam, svc-endpoint; release build), invoked the way a runtime
//! does: `nsenter --net=<node ns> rivet-cni`, a clean environment of `CNI_*`
//! variables, the netconf on stdin (`rivet_testkit::cni`, as its
//! cross-process tests). Each pod is a fresh network namespace; each timing
//! is one plugin process from spawn to exit, so it includes nsenter's
//! fork+exec (~0.5 ms) on both sides.
//!
//! Peer, measured in the same run in the same node namespace and invoked
//! exactly the same way: the reference `bridge` plugin with `host-local`
//! IPAM from /usr/lib/cni (CNI_PATH=/usr/lib/cni), isGateway, no masquerade,
//! on a bridge of its own (`rvbr<pid>`), IPv4 from 198.19.0.0/22 (outside
//! the node's pools), its host-local `dataDir` in the benchmark's temp dir.
//! rivet-cni's ADD does more: an IPv4 and an IPv6 address from svc-ipam and
//! a synchronous svc-endpoint CreateEndpoint (identity, policy, datapath
//! entries in svc-loader) before it returns; bridge assigns one IPv4
//! address and attaches the veth to the bridge.
//!
//! 1. warm-up: `--warmup` ADD+DEL per plugin (not measured);
//! 2. ADD latency p50/p99: `--pods` pods one after the other, each index
//!    added by both plugins back to back, alternating which goes first, so
//!    drift of the machine hits both alike; every ADD must exit 0 with a
//!    result holding an address of the plugin's range;
//! 3. DEL latency p50/p99 of the same pods, interleaved the same way;
//! 4. pods ready per second: `--concurrent` ADDs started at once (one
//!    process each, as a runtime starting that many pods), the wall time
//!    until all returned successfully; rivet-cni first, then bridge; each
//!    round's pods are then deleted at once too (timed separately).
//!
//! add_ratio = rivet-cni ADD p50 / bridge ADD p50 (goal ≤ 2.0),
//! del_ratio = rivet-cni DEL p50 / bridge DEL p50 (goal ≤ 1.2);
//! ratio = add_ratio (lower is better).
//!
//! At the end nothing may be left: no svc-ipam allocation, svc-endpoint
//! endpoint or host veth of rivet-cni's, no host-local reservation or veth
//! of bridge's. The pod namespaces, the node (daemons, namespace with the
//! bridge, pins, temp dir) and the benchmark's temp dir are guards removed
//! on drop, also on error.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::future::join_all;
use rivet_proto::endpoint::v1 as eppb;
use rivet_testkit::cni::{CniRun, PLUGIN_DIR, Pod, exec_in_netns, node_conf, result_ips};
use rivet_testkit::loader::HOST_PREFIX;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use serde_json::{Value, json};

use crate::report::{BenchResult, ms, percentile, sibling_binary};

/// Options of the cni benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct CniArgs {
    /// Pods added (then deleted) one after the other per plugin for the
    /// latency percentiles.
    #[arg(long, default_value_t = 50)]
    pods: usize,
    /// Pods added at once per plugin for pods ready per second.
    #[arg(long, default_value_t = 100)]
    concurrent: usize,
    /// Untimed ADD+DEL per plugin before measuring.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// rivet-cni's `logFile` (default: in the benchmark's temp dir, removed
    /// at the end); give a path to keep it.
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// rivet-cni's `logLevel` (default: none, the plugin's default).
    #[arg(long)]
    log_level: Option<String>,
}

/// CNI version of both netconfs (the newest the reference plugins speak).
const CNI_VERSION: &str = "1.0.0";
/// bridge's host-local range: in 198.18.0.0/15, outside the node's pools
/// (`rivet_testkit::node::POOL4` is 198.18.0.0/22).
const BRIDGE_SUBNET: &str = "198.19.0.0/22";
/// First octets of each plugin's IPv4 addresses, for the result check.
const RIVET_V4: [u8; 2] = [198, 18];
const BRIDGE_V4: [u8; 2] = [198, 19];
/// At most this many pods alive at once: the node's /22 IPv4 pool (1021
/// addresses beside the gateway) and bridge's /22 bound it.
const MAX_PODS: usize = 1000;
/// A plugin run that takes longer has hung.
const RUN_TIMEOUT: Duration = Duration::from_secs(90);
/// Goals of the two ratios (reported, not enforced).
const ADD_RATIO_GOAL: f64 = 2.0;
const DEL_RATIO_GOAL: f64 = 1.2;

/// The two plugins under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plugin {
    Rivet,
    Bridge,
}

impl Plugin {
    fn name(self) -> &'static str {
        match self {
            Self::Rivet => "rivet-cni",
            Self::Bridge => "bridge",
        }
    }
}

/// Both plugins on one node: binaries, netconfs, the node namespace.
struct Bench {
    node_ns: PathBuf,
    rivet_bin: PathBuf,
    rivet_conf: Vec<u8>,
    bridge_bin: PathBuf,
    bridge_conf: Vec<u8>,
    bridge_data: PathBuf,
    bridge_name: String,
}

impl Bench {
    fn bin_conf(&self, plugin: Plugin) -> (&Path, &[u8]) {
        match plugin {
            Plugin::Rivet => (&self.rivet_bin, &self.rivet_conf),
            Plugin::Bridge => (&self.bridge_bin, &self.bridge_conf),
        }
    }

    /// Runs `plugin` for `command` on `pod`'s eth0.
    async fn run(&self, plugin: Plugin, command: &str, pod: &Pod) -> anyhow::Result<CniRun> {
        let (bin, conf) = self.bin_conf(plugin);
        Ok(exec_in_netns(&self.node_ns, bin, &pod.env(command, "eth0"), conf, RUN_TIMEOUT).await?)
    }

    /// ADD that must succeed with an address of the plugin's IPv4 range;
    /// its wall time in ms and the addresses.
    async fn add(&self, plugin: Plugin, pod: &Pod) -> anyhow::Result<(f64, Vec<IpAddr>)> {
        let run = self.run(plugin, "ADD", pod).await?;
        let ips = check_add(plugin, &run, pod)?;
        Ok((ms(run.elapsed), ips))
    }

    /// DEL that must succeed; its wall time in ms.
    async fn del(&self, plugin: Plugin, pod: &Pod) -> anyhow::Result<f64> {
        let run = self.run(plugin, "DEL", pod).await?;
        run.success()
            .map_err(|e| anyhow::anyhow!("DEL of {} ({}): {e}", pod.id, plugin.name()))?;
        Ok(ms(run.elapsed))
    }

    /// `--concurrent` ADDs at once, then as many DELs at once: the wall
    /// times (ms) of both.
    async fn concurrent_round(&self, plugin: Plugin, count: usize) -> anyhow::Result<(f64, f64)> {
        let pods = pods(plugin, "conc", count)?;
        let started = Instant::now();
        let adds = join_all(pods.iter().map(|pod| self.run(plugin, "ADD", pod))).await;
        let add_wall = ms(started.elapsed());
        let mut ips = Vec::with_capacity(count);
        for (run, pod) in adds.into_iter().zip(&pods) {
            ips.extend(check_add(plugin, &run?, pod)?);
        }
        ips.sort();
        ips.dedup();
        anyhow::ensure!(
            ips.len() >= count,
            "{count} concurrent ADDs of {} gave only {} distinct addresses",
            plugin.name(),
            ips.len()
        );
        let started = Instant::now();
        let dels = join_all(pods.iter().map(|pod| self.run(plugin, "DEL", pod))).await;
        let del_wall = ms(started.elapsed());
        for (run, pod) in dels.into_iter().zip(&pods) {
            run?.success()
                .map_err(|e| anyhow::anyhow!("DEL of {} ({}): {e}", pod.id, plugin.name()))?;
        }
        Ok((add_wall, del_wall))
    }
}

/// Checks an ADD: exit 0, a result with addresses, an IPv4 one in the
/// plugin's range.
fn check_add(plugin: Plugin, run: &CniRun, pod: &Pod) -> anyhow::Result<Vec<IpAddr>> {
    let result = run
        .success()
        .map_err(|e| anyhow::anyhow!("ADD of {} ({}): {e}", pod.id, plugin.name()))?;
    let ips = result_ips(&result).unwrap_or_default();
    let range = match plugin {
        Plugin::Rivet => RIVET_V4,
        Plugin::Bridge => BRIDGE_V4,
    };
    anyhow::ensure!(
        ips.iter()
            .any(|ip| matches!(ip, IpAddr::V4(v4) if v4.octets()[..2] == range)),
        "ADD of {} ({}) returned no IPv4 address in {}.{}.0.0/16: {result}",
        pod.id,
        plugin.name(),
        range[0],
        range[1]
    );
    Ok(ips)
}

/// `count` pod namespaces for `plugin` (`<plugin>-<tag>-<i>` container ids).
fn pods(plugin: Plugin, tag: &str, count: usize) -> anyhow::Result<Vec<Pod>> {
    (0..count)
        .map(|i| Ok(Pod::try_new(&format!("{}-{tag}-{i}", plugin.name()))?))
        .collect()
}

/// Runs the benchmark.
pub async fn run(args: &CniArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        args.pods > 0 && args.concurrent > 0 && args.pods.max(args.concurrent) <= MAX_PODS,
        "need 0 < --pods, --concurrent <= {MAX_PODS} (the node's and bridge's /22 ranges)"
    );
    let rivet_bin = sibling_binary("rivet-cni")?;
    for daemon in ["svc-loader", "svc-identity", "svc-ipam", "svc-endpoint"] {
        sibling_binary(daemon)?;
    }
    let bridge_bin = Path::new(PLUGIN_DIR).join("bridge");
    for plugin in ["bridge", "host-local"] {
        let path = Path::new(PLUGIN_DIR).join(plugin);
        anyhow::ensure!(
            path.is_file(),
            "{} is missing (Debian's containernetworking-plugins: cargo xtask install)",
            path.display()
        );
    }
    let bin_dir = rivet_bin
        .parent()
        .ok_or_else(|| anyhow::anyhow!("{} has no parent dir", rivet_bin.display()))?
        .to_path_buf();

    let setup = Instant::now();
    // Guards, dropped on every return path: the temp dir (host-local's
    // reservations, rivet-cni's log), the node (daemons, namespace with
    // every host veth and the bridge, pins, its temp dir). Pods drop first.
    let dir = tempfile::Builder::new().prefix("rivet-bench-cni").tempdir()?;
    let most_pods = args.pods.max(args.concurrent) + 1;
    let node = EndpointNode::start(NodeOptions {
        bin_dir: Some(bin_dir),
        // One entry per endpoint plus one per address (two per pod).
        loader_endpoints_max: Some((3 * most_pods as u32 + 48).max(1024)),
        ..NodeOptions::default()
    })
    .await?;
    let log_file = args
        .log_file
        .clone()
        .unwrap_or_else(|| dir.path().join("rivet-cni.log"));
    let bridge_data = dir.path().join("host-local");
    let bridge_name = format!("rvbr{}", std::process::id());
    let bench = Bench {
        node_ns: node.node.node.ns.path(),
        rivet_conf: node_conf(
            CNI_VERSION,
            &node.sockets(),
            HOST_PREFIX,
            &log_file,
            args.log_level.as_deref(),
        )
        .to_string()
        .into_bytes(),
        rivet_bin,
        bridge_conf: bridge_conf(&bridge_name, &bridge_data).to_string().into_bytes(),
        bridge_bin,
        bridge_data,
        bridge_name,
    };
    println!(
        "setup: node with svc-loader, svc-identity, svc-ipam, svc-endpoint in {:.1} s; bridge {} ({BRIDGE_SUBNET})",
        setup.elapsed().as_secs_f64(),
        bench.bridge_name
    );

    // 1. Warm-up.
    for i in 0..args.warmup {
        for plugin in [Plugin::Rivet, Plugin::Bridge] {
            let pod = Pod::try_new(&format!("{}-warm-{i}", plugin.name()))?;
            bench.add(plugin, &pod).await?;
            bench.del(plugin, &pod).await?;
        }
    }

    // 2. and 3. One after the other, interleaved.
    let rivet_pods = pods(Plugin::Rivet, "seq", args.pods)?;
    let bridge_pods = pods(Plugin::Bridge, "seq", args.pods)?;
    let order = |i: usize| {
        if i.is_multiple_of(2) {
            [Plugin::Rivet, Plugin::Bridge]
        } else {
            [Plugin::Bridge, Plugin::Rivet]
        }
    };
    let pod_of = |plugin: Plugin, i: usize| match plugin {
        Plugin::Rivet => &rivet_pods[i],
        Plugin::Bridge => &bridge_pods[i],
    };
    let (mut rivet_add, mut bridge_add) = (Vec::new(), Vec::new());
    for i in 0..args.pods {
        for plugin in order(i) {
            let (took, _) = bench.add(plugin, pod_of(plugin, i)).await?;
            match plugin {
                Plugin::Rivet => rivet_add.push(took),
                Plugin::Bridge => bridge_add.push(took),
            }
        }
    }
    let ready = node
        .endpoints()
        .await
        .list_endpoints(eppb::ListEndpointsRequest::default())
        .await?
        .into_inner()
        .endpoints
        .iter()
        .filter(|e| e.state == eppb::EndpointState::Ready as i32)
        .count();
    anyhow::ensure!(
        ready == args.pods,
        "svc-endpoint holds {ready} READY endpoints after {} rivet-cni ADDs",
        args.pods
    );
    let (mut rivet_del, mut bridge_del) = (Vec::new(), Vec::new());
    for i in 0..args.pods {
        for plugin in order(i) {
            let took = bench.del(plugin, pod_of(plugin, i)).await?;
            match plugin {
                Plugin::Rivet => rivet_del.push(took),
                Plugin::Bridge => bridge_del.push(took),
            }
        }
    }
    drop(rivet_pods);
    drop(bridge_pods);
    let p = |v: &mut Vec<f64>| (percentile(v, 0.50), percentile(v, 0.99));
    let (rivet_add_p50, rivet_add_p99) = p(&mut rivet_add);
    let (bridge_add_p50, bridge_add_p99) = p(&mut bridge_add);
    let (rivet_del_p50, rivet_del_p99) = p(&mut rivet_del);
    let (bridge_del_p50, bridge_del_p99) = p(&mut bridge_del);

    // 4. Concurrent rounds.
    let (rivet_conc_add, rivet_conc_del) = bench.concurrent_round(Plugin::Rivet, args.concurrent).await?;
    let (bridge_conc_add, bridge_conc_del) = bench.concurrent_round(Plugin::Bridge, args.concurrent).await?;
    let per_s = |wall_ms: f64| args.concurrent as f64 / (wall_ms / 1e3);
    let (rivet_per_s, bridge_per_s) = (per_s(rivet_conc_add), per_s(bridge_conc_add));

    check_nothing_left(&node, &bench).await?;

    let add_ratio = rivet_add_p50 / bridge_add_p50;
    let del_ratio = rivet_del_p50 / bridge_del_p50;
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    let (n, c) = (args.pods, args.concurrent);
    println!();
    println!("{:<34} {:>10} {:>10} {:>8}  goal", "", "rivet-cni", "bridge", "ratio");
    let row = |what: &str, r: f64, b: f64, goal: &str| {
        println!("{what:<34} {r:>10.2} {b:>10.2} {:>8.2}  {goal}", r / b);
    };
    row(
        &format!("ADD p50 ms ({n} sequential)"),
        rivet_add_p50,
        bridge_add_p50,
        &format!("<= {ADD_RATIO_GOAL:.1}: {}", met(add_ratio <= ADD_RATIO_GOAL)),
    );
    row("ADD p99 ms", rivet_add_p99, bridge_add_p99, "");
    row(
        &format!("DEL p50 ms ({n} sequential)"),
        rivet_del_p50,
        bridge_del_p50,
        &format!("<= {DEL_RATIO_GOAL:.1}: {}", met(del_ratio <= DEL_RATIO_GOAL)),
    );
    row("DEL p99 ms", rivet_del_p99, bridge_del_p99, "");
    row(
        &format!("pods ready/s ({c} concurrent ADDs)"),
        rivet_per_s,
        bridge_per_s,
        "(higher is better)",
    );
    row(
        &format!("wall ms of {c} concurrent ADDs"),
        rivet_conc_add,
        bridge_conc_add,
        "",
    );
    row(
        &format!("wall ms of {c} concurrent DELs"),
        rivet_conc_del,
        bridge_conc_del,
        "",
    );
    println!(
        "(each time is one plugin process under nsenter, spawn to exit; rivet-cni assigns IPv4 + IPv6 and \
         creates the endpoint synchronously, bridge one IPv4)"
    );
    println!();

    let metrics = vec![
        ("rivet_add_p50_ms".into(), rivet_add_p50),
        ("rivet_add_p99_ms".into(), rivet_add_p99),
        ("bridge_add_p50_ms".into(), bridge_add_p50),
        ("bridge_add_p99_ms".into(), bridge_add_p99),
        ("add_ratio".into(), add_ratio),
        ("rivet_del_p50_ms".into(), rivet_del_p50),
        ("rivet_del_p99_ms".into(), rivet_del_p99),
        ("bridge_del_p50_ms".into(), bridge_del_p50),
        ("bridge_del_p99_ms".into(), bridge_del_p99),
        ("del_ratio".into(), del_ratio),
        ("rivet_pods_per_s".into(), rivet_per_s),
        ("bridge_pods_per_s".into(), bridge_per_s),
        ("rivet_concurrent_del_ms".into(), rivet_conc_del),
        ("bridge_concurrent_del_ms".into(), bridge_conc_del),
        ("pods".into(), n as f64),
        ("concurrent".into(), c as f64),
        ("add_ratio_goal".into(), ADD_RATIO_GOAL),
        ("del_ratio_goal".into(), DEL_RATIO_GOAL),
        ("add_goal_met".into(), f64::from(u8::from(add_ratio <= ADD_RATIO_GOAL))),
        ("del_goal_met".into(), f64::from(u8::from(del_ratio <= DEL_RATIO_GOAL))),
    ];
    drop(node);
    drop(dir);
    Ok(BenchResult {
        name: "cni".into(),
        metrics,
        ratio: add_ratio,
    })
}

/// bridge + host-local: a bridge of its own acting as the pods' gateway,
/// no masquerade, reservations in `data`.
fn bridge_conf(bridge: &str, data: &Path) -> Value {
    json!({
        "cniVersion": CNI_VERSION,
        "name": "rivet-bench-bridge",
        "type": "bridge",
        "bridge": bridge,
        "isGateway": true,
        "ipMasq": false,
        "ipam": {
            "type": "host-local",
            "dataDir": data,
            "ranges": [[{"subnet": BRIDGE_SUBNET}]],
            "routes": [{"dst": "0.0.0.0/0"}],
        },
    })
}

/// Every pod is gone from both plugins' state: svc-ipam allocations,
/// svc-endpoint endpoints, rivet-cni's and bridge's host veths,
/// host-local's reservations.
async fn check_nothing_left(node: &EndpointNode, bench: &Bench) -> anyhow::Result<()> {
    let allocations = node.allocations().await;
    let endpoints = node
        .endpoints()
        .await
        .list_endpoints(eppb::ListEndpointsRequest::default())
        .await?
        .into_inner()
        .endpoints;
    let links: Value = serde_json::from_str(&node.node.node.ns.ip(&["-j", "link", "show", "type", "veth"])?)?;
    let veths: Vec<&str> = links
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["ifname"].as_str())
        .filter(|name| name.starts_with(HOST_PREFIX) || name.starts_with("veth"))
        .collect();
    // host-local keeps one file per reserved address, besides its
    // `last_reserved_ip.<range>` and `lock`.
    let network_dir = bench.bridge_data.join("rivet-bench-bridge");
    let mut reserved = Vec::new();
    if network_dir.is_dir() {
        for entry in std::fs::read_dir(&network_dir)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if !(name.starts_with("last_reserved_ip") || name == "lock") {
                reserved.push(name);
            }
        }
    }
    anyhow::ensure!(
        allocations.is_empty() && endpoints.is_empty() && veths.is_empty() && reserved.is_empty(),
        "left behind: {} svc-ipam allocations, {} endpoints, veths {veths:?}, host-local reservations {reserved:?}",
        allocations.len(),
        endpoints.len()
    );
    Ok(())
}
