//! `scale` (issue 19 §5, resource bounds): one real node at the sizes of a
//! large cluster, and what its daemons cost there. The node is the testkit's
//! [`EndpointNode`]: svc-loader in a network namespace of the bench's own,
//! svc-ipam, svc-identity on a real etcd, svc-endpoint and svc-gc, real
//! processes from the bench's own build directory. It is brought to:
//!
//! 1. `--identities` identities in the store (100,000): the simulated nodes
//!    of [`rivet_testkit::scale`] (`--remote-nodes` x `--remote-pods`
//!    remote pods, their apps' identities allocated the real way, a lease
//!    each) and the rest put in batches with svc-identity's key layout
//!    ([`SimulatedCluster::add_identities`]), until svc-identity's cache
//!    holds them all and the pinned ipcache every remote pod;
//! 2. `--endpoints` endpoints (10,000): veth pairs in the node namespace,
//!    an address each from svc-ipam and a synchronous CreateEndpoint each
//!    through svc-endpoint's API (identity, policy, svc-loader's
//!    ApplyEndpoint, tc filters, state file: the `endpoint` bench's
//!    endpoints), then one NetworkPolicy selecting all of them, checked in
//!    svc-loader;
//! 3. `--ct-entries` conntrack entries (1M) in the loader's pinned ct4,
//!    established TCP flows of the endpoints (no orphans), written in
//!    batches as the `gc` bench does, then one svc-gc pass over them
//!    (RunNow).
//!
//! Then, over `--idle-seconds` of idle (nothing asked of the node), each
//! daemon's CPU seconds (`/proc/<pid>/stat`), and at the end its VmRSS, Pss
//! and Private_Dirty (`/proc/<pid>/status`, `smaps_rollup`). svc-health
//! does not run on a node outside a cluster (`rivet node up` starts it only
//! with `--health-endpoint`), so it is not counted.
//!
//! ratio = the node daemons' summed VmRSS / `--goal-mib` (256 MiB; Cilium's
//! agent is ~438 MiB on large clusters): at most 1 meets the goal, and the
//! bench fails (after writing its figures) when it is not met. VmRSS counts
//! shared library pages in every daemon: the sum is an upper bound of what
//! they use together (the Pss sum is that figure).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use rivet_common::grpc::{ClientOptions, DaemonChannel};
use rivet_common::testing::etcd::EtcdServer;
use rivet_datapath::spec;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::endpoint::v1::policy_service_client::PolicyServiceClient;
use rivet_proto::gc::v1 as gcpb;
use rivet_proto::gc::v1::gc_service_client::GcServiceClient;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use rivet_testkit::scale::{BULK_FIRST_ID, IpcacheReader, ScaleSpec, SimulatedCluster, pinned_map_memory};
use svc_gc::clock::{Clock as _, KernelClock};
use svc_gc::map::{BatchMode, PinnedMap};

use crate::endpoint::{POLICY, check_datapath, create_all, endpoint_requests};
use crate::procfs::{Memory, cpu_seconds, memory, pid};
use crate::report::{BenchResult, load_average, sibling_binary};

/// How long the store may take to reach the node.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(900);
/// Client deadline: a policy realised on every endpoint, a gc pass over
/// the whole map (debug builds).
const CALL_TIMEOUT: Duration = Duration::from_secs(600);
/// Endpoints created between two progress lines.
const PROGRESS_EVERY: usize = 1000;
/// The node's pods: `198.18.0.0/<len>`, large enough for `--endpoints`.
const POOL_BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);
/// Lifetime of the conntrack entries, seconds (the datapath's established
/// TCP default: nothing expires during the run).
const CT_LIFETIME_S: u32 = 21_600;
/// svc-loader's policy map, all endpoints together: the policy gives each
/// endpoint a few dozen entries (LPM trie, allocated on use).
const POLICY_MAX: u32 = 1 << 20;

/// Options of the scale benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct ResourceArgs {
    /// Endpoints on the node.
    #[arg(long, default_value_t = 10_000)]
    endpoints: u32,
    /// Identities in the store (those of the remote pods' apps included).
    #[arg(long, default_value_t = 100_000)]
    identities: u32,
    /// Conntrack entries (ct4).
    #[arg(long, default_value_t = 1_000_000)]
    ct_entries: u32,
    /// Simulated remote nodes publishing pods.
    #[arg(long, default_value_t = 10)]
    remote_nodes: u32,
    /// Pods per simulated remote node.
    #[arg(long, default_value_t = 200)]
    remote_pods: u32,
    /// Concurrent CreateEndpoint calls.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Seconds of idle over which the daemons' CPU is measured.
    #[arg(long, default_value_t = 60)]
    idle_seconds: u64,
    /// The node daemons' summed VmRSS may not exceed this, MiB.
    #[arg(long, default_value_t = 256.0)]
    goal_mib: f64,
}

/// One node daemon being measured.
struct Daemon {
    /// Its process name (`comm`).
    name: &'static str,
    pid: u32,
}

/// The smallest prefix length of a pool holding `count` pods beside the
/// network, gateway and broadcast addresses.
fn pool_prefix_len(count: u32) -> u8 {
    let needed = u64::from(count) + 3;
    (0..=30u8).rev().find(|len| 1u64 << (32 - len) >= needed).unwrap_or(0)
}

/// Runs the benchmark.
pub async fn run(args: &ResourceArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        args.endpoints > 0 && args.concurrency > 0 && args.remote_nodes > 0,
        "need --endpoints, --concurrency and --remote-nodes above 0"
    );
    let prefix_len = pool_prefix_len(args.endpoints);
    anyhow::ensure!(
        prefix_len >= 15,
        "{} endpoints do not fit 198.18.0.0/15",
        args.endpoints
    );
    let bin_dir = sibling_binary("svc-loader")?
        .parent()
        .map(std::path::Path::to_path_buf)
        .ok_or_else(|| anyhow::anyhow!("the benchmark binary has no directory"))?;
    for daemon in ["svc-identity", "svc-ipam", "svc-endpoint", "svc-gc"] {
        sibling_binary(daemon)?;
    }
    let spec = ScaleSpec::new(args.remote_nodes, args.remote_pods);
    // Apps some remote pod runs: the identities the simulated nodes allocate.
    let app_identities = spec.apps.min(args.remote_nodes * args.remote_pods);
    let bulk = args.identities.saturating_sub(app_identities);
    let max_identity = (BULK_FIRST_ID + bulk).max(rivet_common::identity::DEFAULT_MAX_CLUSTER_IDENTITY);
    let load_before = load_average()?;
    let started = Instant::now();

    // Guards, dropped on every return path: the node (daemons, namespace
    // with every veth, pins, temp dir), then etcd (its data dir).
    let etcd = EtcdServer::start_async().await?;
    let node = EndpointNode::start(NodeOptions {
        bin_dir: Some(bin_dir),
        loader_endpoints_max: Some(2 * args.endpoints + 48),
        pool4: Some(format!("{POOL_BASE}/{prefix_len}")),
        loader_args: vec![
            "--ct-max".into(),
            (args.ct_entries + args.ct_entries / 4).max(65_536).to_string(),
            "--policy-max".into(),
            POLICY_MAX.to_string(),
        ],
        identity_args: vec![
            "--etcd-endpoints".into(),
            etcd.endpoint(),
            "--cluster-name".into(),
            spec.cluster.clone(),
            "--max-identity".into(),
            max_identity.to_string(),
        ],
        gc_args: Some(Vec::new()),
        ..NodeOptions::default()
    })
    .await?;
    let daemons = [
        Daemon {
            name: "svc-loader",
            pid: pid(node.node.loader.pid())?,
        },
        Daemon {
            name: "svc-gc",
            pid: pid(node.gc.as_ref().and_then(|gc| gc.pid()))?,
        },
        Daemon {
            name: "svc-ipam",
            pid: pid(node.ipam.pid())?,
        },
        Daemon {
            name: "svc-identity",
            pid: pid(node.identity.pid())?,
        },
        Daemon {
            name: "svc-endpoint",
            pid: pid(node.endpoint.as_ref().and_then(|e| e.pid()))?,
        },
    ];
    let idle: Vec<Memory> = daemons
        .iter()
        .map(|d| memory(d.pid, d.name))
        .collect::<Result<_, _>>()?;
    let node_up_s = started.elapsed().as_secs_f64();
    println!(
        "node up in {node_up_s:.1} s (pool {POOL_BASE}/{prefix_len}); VmRSS idle: {}",
        daemons
            .iter()
            .zip(&idle)
            .map(|(d, m)| format!("{} {:.1} MiB", d.name, m.rss))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let options = ClientOptions {
        request_timeout: CALL_TIMEOUT,
        ..ClientOptions::default()
    };

    // 1. The store: remote nodes and pods, then identities up to the count.
    let step = Instant::now();
    let cluster = SimulatedCluster::publish(&etcd.endpoint(), spec).await?;
    let ids = cluster.add_identities(bulk).await?;
    let published_s = step.elapsed().as_secs_f64();
    let total_identities = app_identities + ids.len() as u32;
    let mut identity = IdentityServiceClient::new(node.connect("svc-identity", &options).await?);
    let cached = wait_identities(&mut identity, total_identities).await?;
    let ipcache = IpcacheReader::open(&node.node.pins.0)?;
    if let Err(missing) = ipcache
        .wait_for(cluster.expected(), Duration::from_millis(50), CONVERGE_TIMEOUT)
        .await?
    {
        anyhow::bail!(
            "the pinned ipcache misses {} of {} remote pods after {CONVERGE_TIMEOUT:?}, e.g. {:?}",
            missing.len(),
            cluster.expected().len(),
            &missing[..missing.len().min(3)]
        );
    }
    let identities_s = step.elapsed().as_secs_f64();
    println!(
        "store: {} remote nodes x {} pods and {total_identities} identities written in {published_s:.1} s; \
         svc-identity caches {cached} cluster identities and the ipcache holds every remote pod {identities_s:.1} s \
         after the first write",
        args.remote_nodes, args.remote_pods
    );

    // 2. Endpoints, then one policy selecting them all.
    let step = Instant::now();
    let ipam = IpamClient::new(node.connect("svc-ipam", &options).await?);
    let requests = endpoint_requests(&node, &ipam, args.endpoints, args.concurrency).await?;
    let wired_s = step.elapsed().as_secs_f64();
    println!(
        "{} veth pairs in the node namespace and as many addresses from svc-ipam in {wired_s:.1} s",
        requests.len()
    );
    let endpoints = EndpointServiceClient::new(node.connect("svc-endpoint", &options).await?);
    let create = Instant::now();
    for (i, chunk) in requests.chunks(PROGRESS_EVERY).enumerate() {
        let took = create_all(&endpoints, chunk, args.concurrency).await?;
        let rss: f64 = daemons
            .iter()
            .map(|d| memory(d.pid, d.name).map(|m| m.rss))
            .sum::<anyhow::Result<f64>>()?;
        println!(
            "  {} endpoints: {:.1} s, {:.1} ms per endpoint for the last {} ({} concurrent); daemons' VmRSS {rss:.1} MiB",
            i * PROGRESS_EVERY + chunk.len(),
            create.elapsed().as_secs_f64(),
            took.as_secs_f64() * 1e3 / chunk.len() as f64,
            chunk.len(),
            args.concurrency
        );
    }
    let create_s = create.elapsed().as_secs_f64();
    let per_endpoint_ms = create_s * 1e3 / f64::from(args.endpoints);
    for (d, m) in daemons.iter().zip(daemons.iter().map(|d| memory(d.pid, d.name))) {
        let m = m?;
        println!(
            "  {:<13} VmRSS {:>6.1} MiB, Pss {:>6.1} before the policy",
            d.name, m.rss, m.pss
        );
    }
    let n = args.endpoints as usize;
    let mut loader = LoaderServiceClient::new(node.connect("svc-loader", &options).await?);
    let policy_started = Instant::now();
    let mut policies = PolicyServiceClient::new(node.connect("svc-endpoint", &options).await?);
    let upsert = pb::UpsertPolicyRequest {
        document: POLICY.into(),
        origin: pb::PolicyOrigin::Api.into(),
        wait: true,
    };
    let entries = match policies.upsert_policy(upsert.clone()).await {
        Ok(upserted) => {
            let upserted = upserted.into_inner();
            anyhow::ensure!(
                upserted.affected_endpoints as usize == n && upserted.realised_endpoints as usize == n,
                "the policy must select and be realised on all {n} endpoints: {upserted:?}"
            );
            check_datapath(&mut loader, n, upserted.revision).await?
        }
        // svc-endpoint's wait has a deadline of its own; the regenerations
        // go on: the datapath is the judge.
        Err(status) if status.code() == tonic::Code::DeadlineExceeded => {
            println!(
                "  UpsertPolicy(wait) gave up after {:.1} s: {}; polling svc-loader",
                policy_started.elapsed().as_secs_f64(),
                status.message()
            );
            // The same document again: unchanged, it answers its revision.
            let mut upsert = upsert;
            upsert.wait = false;
            let revision = policies.upsert_policy(upsert).await?.into_inner().revision;
            loop {
                match check_datapath(&mut loader, n, revision).await {
                    Ok(entries) => break entries,
                    // Not there yet; the next look in a second.
                    Err(_) if policy_started.elapsed() < CALL_TIMEOUT => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Err(status) => return Err(status.into()),
    };
    let policy_s = policy_started.elapsed().as_secs_f64();
    let endpoints_s = step.elapsed().as_secs_f64();
    println!(
        "{n} endpoints created in {create_s:.1} s ({per_endpoint_ms:.1} ms each, {:.0}/s); a policy selecting all \
         realised in {policy_s:.1} s ({entries} entries each in svc-loader); {endpoints_s:.1} s for the step",
        f64::from(args.endpoints) / create_s
    );

    // 3. Conntrack: the endpoints' flows, then one full svc-gc pass.
    let step = Instant::now();
    let sources = requests
        .iter()
        .map(|r| {
            let a = r.addresses.first().map(|a| a.address.as_slice()).unwrap_or_default();
            <[u8; 4]>::try_from(a)
                .map(Ipv4Addr::from)
                .map_err(|_| anyhow::anyhow!("endpoint {} has no IPv4 address", r.container_id))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (keys, values) = rivet_testkit::gc::flows_from(
        &sources,
        args.ct_entries,
        KernelClock::new().monotonic_nanos(),
        CT_LIFETIME_S,
    );
    let mut ct4 = PinnedMap::open(&node.node.pins.0, &spec::CT4, BatchMode::Auto)?;
    ct4.insert_all(&keys, &values)?;
    drop((keys, values));
    let written_s = step.elapsed().as_secs_f64();
    let pass = GcServiceClient::new(node.connect("svc-gc", &options).await?)
        .run_now(gcpb::RunNowRequest {})
        .await?
        .into_inner()
        .pass
        .ok_or_else(|| anyhow::anyhow!("svc-gc's RunNow returned no pass"))?;
    let deleted = pass.deleted.unwrap_or_default();
    anyhow::ensure!(
        pass.scanned >= u64::from(args.ct_entries) && deleted.expired == 0 && deleted.orphaned_endpoint == 0,
        "svc-gc's pass must scan all {} entries and delete none of these live flows: {pass:?}",
        args.ct_entries
    );
    let pass_ms = pass.duration_nanos as f64 / 1e6;
    println!(
        "{} conntrack entries written in {written_s:.1} s; a svc-gc pass scanned {} in {pass_ms:.0} ms, deleted none",
        args.ct_entries, pass.scanned
    );
    let at_scale_s = started.elapsed().as_secs_f64();

    // Idle: CPU over the window, memory at its end.
    let cpu0: Vec<f64> = daemons.iter().map(|d| cpu_seconds(d.pid)).collect::<Result<_, _>>()?;
    let window = Instant::now();
    // The measurement window itself, not a wait for something to happen.
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let cpu1: Vec<f64> = daemons.iter().map(|d| cpu_seconds(d.pid)).collect::<Result<_, _>>()?;
    let window_s = window.elapsed().as_secs_f64();
    let at_scale: Vec<Memory> = daemons
        .iter()
        .map(|d| memory(d.pid, d.name))
        .collect::<Result<_, _>>()?;
    let maps_mib = |name: &str| -> anyhow::Result<f64> {
        Ok(pinned_map_memory(&node.node.pins.0.join(name))? as f64 / (1024.0 * 1024.0))
    };
    let (ct4_mib, ipcache_mib, policy_mib) = (maps_mib("ct4")?, maps_mib("ipcache")?, maps_mib("policy")?);

    let mut metrics = vec![
        ("endpoints".into(), f64::from(args.endpoints)),
        ("identities".into(), f64::from(total_identities)),
        ("ct_entries".into(), f64::from(args.ct_entries)),
        ("remote_pods".into(), f64::from(args.remote_nodes * args.remote_pods)),
        ("node_up_s".into(), node_up_s),
        ("store_written_s".into(), published_s),
        ("identities_converged_s".into(), identities_s),
        ("veths_and_addresses_s".into(), wired_s),
        ("endpoints_created_s".into(), create_s),
        ("ms_per_endpoint".into(), per_endpoint_ms),
        ("policy_all_endpoints_s".into(), policy_s),
        ("ct_written_s".into(), written_s),
        ("gc_pass_ms".into(), pass_ms),
        ("at_scale_s".into(), at_scale_s),
        ("idle_window_s".into(), window_s),
    ];
    println!(
        "at scale {at_scale_s:.0} s after the start; idle {window_s:.0} s (load average before {load_before:.1}):"
    );
    let (mut rss_sum, mut pss_sum, mut dirty_sum, mut cpu_sum) = (0.0, 0.0, 0.0, 0.0);
    for (((d, m), m0), (c0, c1)) in daemons.iter().zip(&at_scale).zip(&idle).zip(cpu0.iter().zip(&cpu1)) {
        let cpu = c1 - c0;
        let core_percent = 100.0 * cpu / window_s;
        println!(
            "  {:<13} VmRSS {:>6.1} MiB (idle {:>5.1}), Pss {:>6.1}, Private_Dirty {:>6.1}, {:>3} threads; \
             CPU {cpu:.2} s = {core_percent:.2}% of a core",
            d.name, m.rss, m0.rss, m.pss, m.private_dirty, m.threads
        );
        let key = d.name.replace('-', "_");
        metrics.push((format!("{key}_rss_mib"), m.rss));
        metrics.push((format!("{key}_rss_idle_mib"), m0.rss));
        metrics.push((format!("{key}_pss_mib"), m.pss));
        metrics.push((format!("{key}_private_dirty_mib"), m.private_dirty));
        metrics.push((format!("{key}_cpu_percent"), core_percent));
        rss_sum += m.rss;
        pss_sum += m.pss;
        dirty_sum += m.private_dirty;
        cpu_sum += cpu;
    }
    let cpu_percent = 100.0 * cpu_sum / window_s;
    let met = rss_sum <= args.goal_mib;
    println!(
        "  {:<13} VmRSS {rss_sum:>6.1} MiB, Pss {pss_sum:>6.1}, Private_Dirty {dirty_sum:>6.1}; CPU {cpu_sum:.2} s = \
         {cpu_percent:.2}% of a core",
        "sum"
    );
    println!(
        "goal: the node daemons' VmRSS <= {:.0} MiB (Cilium's agent ~438 MiB on large clusters): {}; kernel memory \
         of the maps (not in any RSS): ct4 {ct4_mib:.1} MiB, ipcache {ipcache_mib:.1} MiB, policy {policy_mib:.1} MiB",
        args.goal_mib,
        if met { "met" } else { "NOT met" }
    );
    metrics.extend([
        ("rss_sum_mib".into(), rss_sum),
        ("pss_sum_mib".into(), pss_sum),
        ("private_dirty_sum_mib".into(), dirty_sum),
        ("cpu_sum_percent".into(), cpu_percent),
        ("goal_mib".into(), args.goal_mib),
        ("goal_met".into(), f64::from(u8::from(met))),
        ("ct4_map_mib".into(), ct4_mib),
        ("ipcache_map_mib".into(), ipcache_mib),
        ("policy_map_mib".into(), policy_mib),
        ("load_average_1m_before".into(), load_before),
        ("load_average_1m_after".into(), load_average()?),
    ]);
    drop(ct4);
    drop(ipcache);
    cluster.withdraw().await;
    drop(node);
    drop(etcd);
    let result = BenchResult {
        name: "scale".into(),
        metrics,
        ratio: rss_sum / args.goal_mib,
    };
    if !met {
        result.publish(&crate::report::target_dir()?)?;
        anyhow::bail!(
            "the node daemons' VmRSS sum {rss_sum:.1} MiB exceeds the goal of {:.0} MiB",
            args.goal_mib
        );
    }
    Ok(result)
}

/// Polls svc-identity's status until its cache holds `count` cluster
/// identities; returns how many it holds.
async fn wait_identities(client: &mut IdentityServiceClient<DaemonChannel>, count: u32) -> anyhow::Result<u32> {
    let started = Instant::now();
    loop {
        let status = client.get_status(idpb::GetStatusRequest {}).await?.into_inner();
        if status.cluster_identities >= count {
            return Ok(status.cluster_identities);
        }
        anyhow::ensure!(
            started.elapsed() < CONVERGE_TIMEOUT,
            "svc-identity caches {} of {count} identities after {CONVERGE_TIMEOUT:?}",
            status.cluster_identities
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_fits_the_endpoints() {
        assert_eq!(pool_prefix_len(1), 30);
        assert_eq!(pool_prefix_len(1000), 22);
        assert_eq!(pool_prefix_len(10_000), 18);
        assert_eq!(pool_prefix_len(16_381), 18);
        assert_eq!(pool_prefix_len(16_382), 17);
    }
}
