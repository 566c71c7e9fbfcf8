//! `multinode-scale` (issue 16 §7): `--nodes` simulated nodes x `--pods`
//! pods published in a real etcd by the load generator
//! ([`rivet_testkit::scale`]: svc-identity's own store code, a lease per
//! node, identities allocated the real way) until one real node — svc-identity
//! on that etcd pushing to svc-loader in a node namespace — holds every
//! remote pod in its pinned ipcache with the right identity and tunnel
//! endpoint (read from the map itself, every 5 ms).
//!
//! Reports:
//! - `publish_s`: the generator's writes (first connect to last put);
//!   `converge_s`: from the first write until the map holds all entries;
//! - VmRSS of svc-identity and svc-loader before (idle, connected) and
//!   after, and the CPU seconds each spent during convergence
//!   (`/proc/<pid>/stat`);
//! - one more pod: `--samples` times (sequentially, spread over the nodes),
//!   the time from the start of the etcd put until the entry is in the
//!   pinned map (polled every 100 µs): p50 and p99, ms;
//! - `join_converge_s`: then a second real node starts on the populated
//!   etcd: time from its start until its pinned ipcache holds every entry
//!   (the listing path, where the first node learnt them by watch);
//! - `entry_bytes`: key + value bytes of one IP entry in etcd (what every
//!   node's watch receives per remote pod).
//!
//! ratio = converge_s / publish_s: how far behind the writers the real
//! node finishes (1.0: it keeps up with the generator).

use std::time::{Duration, Instant};

use rivet_common::testing::etcd::EtcdServer;
use rivet_testkit::scale::{EtcdNode, ExpectedEntry, IpcacheReader, MAX_PODS_PER_NODE, ScaleSpec, SimulatedCluster};

use crate::report::{BenchResult, load_average, ms, percentile, sibling_binary};

/// How long convergence may take before the benchmark gives up.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a node joining the populated cluster may take to hold it all.
const JOIN_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one more pod may take.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Options of the scale benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Simulated nodes.
    #[arg(long, default_value_t = 50)]
    pub nodes: u32,
    /// Pods per simulated node.
    #[arg(long, default_value_t = 200)]
    pub pods: u32,
    /// Distinct pod label sets (identities) in the cluster.
    #[arg(long, default_value_t = 100)]
    pub apps: u32,
    /// One-more-pod latency samples (at least 200 for a p99 worth the name).
    #[arg(long, default_value_t = 200)]
    pub samples: u32,
}

/// Runs the benchmark.
pub async fn run(args: &ScaleArgs) -> anyhow::Result<BenchResult> {
    Ok(BenchResult {
        name: "multinode-scale".into(),
        ..measure(args).await?
    })
}

/// The measurement, also part of `multinode`.
pub async fn measure(args: &ScaleArgs) -> anyhow::Result<BenchResult> {
    let extra_per_node = MAX_PODS_PER_NODE.saturating_sub(args.pods);
    anyhow::ensure!(
        args.samples > 0 && args.samples <= args.nodes * extra_per_node,
        "--samples must be between 1 and {} (one-more pods fit {extra_per_node} per node beside --pods {})",
        args.nodes * extra_per_node,
        args.pods
    );
    let mut spec = ScaleSpec::new(args.nodes, args.pods);
    spec.apps = args.apps;
    let total = args.nodes * args.pods;
    let bin_dir = sibling_binary("svc-loader")?
        .parent()
        .map(std::path::Path::to_path_buf)
        .ok_or_else(|| anyhow::anyhow!("the benchmark binary has no directory"))?;
    let etcd = EtcdServer::start_async().await?;
    // Room for every remote pod, the extra ones and the node addresses.
    let ipcache_max = (total + args.samples + 2 * args.nodes + 1024).next_power_of_two();
    let node = EtcdNode::start(&bin_dir, &etcd.endpoint(), &spec.cluster, ipcache_max, &[]).await?;
    let ipcache = node.ipcache()?;
    let identity_pid = crate::procfs::pid(node.identity.pid())?;
    let loader_pid = crate::procfs::pid(node.node.loader.pid())?;
    let (identity_rss_idle, loader_rss_idle) = (
        crate::procfs::rss_mib(identity_pid, "svc-identity")?,
        crate::procfs::rss_mib(loader_pid, "svc-loader")?,
    );
    let (identity_cpu0, loader_cpu0) = (
        crate::procfs::cpu_seconds(identity_pid)?,
        crate::procfs::cpu_seconds(loader_pid)?,
    );
    let load_before = load_average()?;

    let started = Instant::now();
    let cluster = SimulatedCluster::publish(&etcd.endpoint(), spec).await?;
    let published = started.elapsed();
    match ipcache
        .wait_for(cluster.expected(), Duration::from_millis(5), CONVERGE_TIMEOUT)
        .await?
    {
        Ok(_) => {}
        Err(missing) => anyhow::bail!(
            "{} of {total} entries missing or wrong after {CONVERGE_TIMEOUT:?}, e.g. {:?}",
            missing.len(),
            missing[0]
        ),
    }
    let converged = started.elapsed();
    let identity_cpu = crate::procfs::cpu_seconds(identity_pid)? - identity_cpu0;
    let loader_cpu = crate::procfs::cpu_seconds(loader_pid)? - loader_cpu0;
    let identity_rss = crate::procfs::rss_mib(identity_pid, "svc-identity")?;
    let map_bytes = ipcache.memory_bytes()?;
    let loader_rss = crate::procfs::rss_mib(loader_pid, "svc-loader")?;
    println!(
        "{} nodes x {} pods ({total} entries, {} identities): published in {:.2} s, in the real node's ipcache after \
         {:.2} s; svc-identity VmRSS {identity_rss_idle:.1} -> {identity_rss:.1} MiB, CPU {identity_cpu:.2} s; \
         svc-loader VmRSS {loader_rss_idle:.1} -> {loader_rss:.1} MiB, CPU {loader_cpu:.2} s; ipcache map {:.2} MiB \
         (kernel memory)",
        args.nodes,
        args.pods,
        args.apps.min(total),
        published.as_secs_f64(),
        converged.as_secs_f64(),
        map_bytes as f64 / (1024.0 * 1024.0)
    );

    let (identity_cpu1, loader_cpu1) = (
        crate::procfs::cpu_seconds(identity_pid)?,
        crate::procfs::cpu_seconds(loader_pid)?,
    );
    let mut latencies = Vec::with_capacity(args.samples as usize);
    let mut all = cluster.expected().to_vec();
    for s in 0..args.samples {
        let (entry, took) = one_more_pod(&cluster, &ipcache, s % args.nodes, s / args.nodes).await?;
        latencies.push(ms(took));
        all.push(entry);
    }
    let identity_cpu_per_pod = (crate::procfs::cpu_seconds(identity_pid)? - identity_cpu1) / f64::from(args.samples);
    let loader_cpu_per_pod = (crate::procfs::cpu_seconds(loader_pid)? - loader_cpu1) / f64::from(args.samples);
    let (p50, p99) = (percentile(&mut latencies, 0.50), percentile(&mut latencies, 0.99));
    println!(
        "one more pod ({} samples): etcd put -> pinned ipcache p50 {p50:.2} ms, p99 {p99:.2} ms; CPU per pod: \
         svc-identity {:.3} ms, svc-loader {:.3} ms",
        args.samples,
        identity_cpu_per_pod * 1e3,
        loader_cpu_per_pod * 1e3
    );

    // A node joining the cluster now learns it all from one listing.
    let started = Instant::now();
    let joiner = EtcdNode::start(&bin_dir, &etcd.endpoint(), &cluster.spec().cluster, ipcache_max, &[]).await?;
    let joined = joiner
        .ipcache()?
        .wait_for(&all, Duration::from_millis(5), JOIN_TIMEOUT)
        .await?;
    let join_s = match joined {
        Ok(_) => started.elapsed().as_secs_f64(),
        Err(missing) => {
            let log = joiner.identity.log();
            let tail = &log[log.len().saturating_sub(3000)..];
            anyhow::bail!(
                "a node joining the cluster of {} entries lacks {} after {JOIN_TIMEOUT:?}; its svc-identity log ends:\n{tail}",
                all.len(),
                missing.len()
            )
        }
    };
    let joiner_rss = crate::procfs::rss_mib(crate::procfs::pid(joiner.identity.pid())?, "svc-identity")?;
    println!(
        "a node joining now: its ipcache holds all {} entries {join_s:.2} s after its daemons started (svc-identity VmRSS {joiner_rss:.1} MiB)",
        all.len()
    );
    drop(joiner);

    let entry_bytes = cluster.entry_bytes() as f64 / f64::from(total);
    let per_entry = |after: f64, before: f64| (after - before) * 1024.0 * 1024.0 / f64::from(total);
    cluster.withdraw().await;
    drop(node);

    Ok(BenchResult {
        name: String::new(),
        metrics: vec![
            ("nodes".into(), f64::from(args.nodes)),
            ("pods_per_node".into(), f64::from(args.pods)),
            ("entries".into(), f64::from(total)),
            ("publish_s".into(), published.as_secs_f64()),
            ("converge_s".into(), converged.as_secs_f64()),
            ("identity_rss_idle_mib".into(), identity_rss_idle),
            ("identity_rss_mib".into(), identity_rss),
            (
                "identity_bytes_per_entry".into(),
                per_entry(identity_rss, identity_rss_idle),
            ),
            ("identity_cpu_converge_s".into(), identity_cpu),
            ("loader_rss_idle_mib".into(), loader_rss_idle),
            ("loader_rss_mib".into(), loader_rss),
            ("loader_cpu_converge_s".into(), loader_cpu),
            ("ipcache_map_mib".into(), map_bytes as f64 / (1024.0 * 1024.0)),
            (
                "ipcache_map_bytes_per_entry".into(),
                map_bytes as f64 / f64::from(total),
            ),
            ("one_more_pod_p50_ms".into(), p50),
            ("one_more_pod_p99_ms".into(), p99),
            ("identity_cpu_per_pod_ms".into(), identity_cpu_per_pod * 1e3),
            ("loader_cpu_per_pod_ms".into(), loader_cpu_per_pod * 1e3),
            ("entry_bytes".into(), entry_bytes),
            ("join_converge_s".into(), join_s),
            ("join_identity_rss_mib".into(), joiner_rss),
            ("load_average_1m_before".into(), load_before),
            ("load_average_1m_after".into(), load_average()?),
        ],
        ratio: converged.as_secs_f64() / published.as_secs_f64(),
    })
}

/// Publishes pod `extra` beyond the spec's on simulated node `node`;
/// returns it and the time from the start of the put until the pinned map
/// holds it.
async fn one_more_pod(
    cluster: &SimulatedCluster,
    ipcache: &IpcacheReader,
    node: u32,
    extra: u32,
) -> anyhow::Result<(ExpectedEntry, Duration)> {
    let started = Instant::now();
    let entry = cluster.add_pod(node, extra).await?;
    // A blocking poll every 100 µs: tokio's timer is 1 ms coarse.
    let seen = tokio::task::block_in_place(|| {
        while started.elapsed() < SAMPLE_TIMEOUT {
            if ipcache.holds(&entry)? {
                return Ok(Some(started.elapsed()));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok::<_, rivet_testkit::scale::ScaleError>(None)
    })?;
    let took = seen.ok_or_else(|| anyhow::anyhow!("{entry:?} not in the ipcache after {SAMPLE_TIMEOUT:?}"))?;
    Ok((entry, took))
}
