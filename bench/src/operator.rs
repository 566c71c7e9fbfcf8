//! `operator`: rivet-operator's duties against the real stores, in-process
//! (the duties' library entry points, a term begun by hand as in their
//! tests), each against a peer measured in the same run:
//!
//! 1. **Nodes joining.** `--nodes` nodes join a real kube-apiserver, each a
//!    Node (kubelet's registration) and its RivetNode (svc-k8s-sync's,
//!    without pod CIDRs), created `--api-concurrency` at a time, as fast as
//!    the API takes them, while the cluster-pool duty runs: the time from
//!    the first create until every RivetNode holds a pod CIDR of each
//!    family (the duty's own watch: `PoolHandle::wait_all_allocated`), and
//!    nodes/s. Peer: the same creates with no duty running (the API's own
//!    rate), on other names, before. `join_ratio` = join / creates.
//! 2. **Identity GC.** `--identities` identities on etcd 3.6 (masters, and
//!    value keys for all but `--unused-percent` of them), svc-identity's
//!    key layout. Round 1 of the etcd GC (the scan that marks the unused)
//!    against a raw paged range scan of the same keys (value keys keys-only,
//!    then the masters with values, `--page-size` a page, one revision),
//!    interleaved `--scan-rounds` times, medians; then round 2 (the deletes,
//!    rate limit raised to `--delete-qps`) and its deletes/s.
//!    ratio = GC round 1 / raw scan (goal ≤ 2).

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use etcd_client::{Client as EtcdClient, GetOptions, Txn, TxnOp};
use futures::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use rivet_common::controller::Controllers;
use rivet_common::testing::etcd::EtcdServer;
use rivet_k8s::RivetNode;
use rivet_operator::cluster_pool::allocator::PoolConfig;
use rivet_operator::cluster_pool::{ClusterPool, PoolMetrics};
use rivet_operator::identity_gc::etcd::EtcdIdentityGc;
use rivet_operator::identity_gc::{DeleteRate, IdentityGcMetrics};
use rivet_operator::kvstore::Layout;
use rivet_operator::term::Term;
use rivet_testkit::kube::KubeApiServer;
use serde_json::json;

use crate::report::{BenchResult, load_average, ms, percentile};

/// How long one measured step may take before the benchmark gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(600);
/// Puts per etcd transaction while filling (etcd's --max-txn-ops is 128).
const FILL_BATCH: usize = 100;
/// Nodes the value keys are spread over.
const VALUE_NODES: u32 = 50;
/// The first cluster identity.
const FIRST_ID: u32 = 256;

/// Options of the operator benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct OperatorArgs {
    /// Nodes joining in (1).
    #[arg(long, default_value_t = 1000)]
    nodes: u32,
    /// Concurrent creates against the API server.
    #[arg(long, default_value_t = 32)]
    api_concurrency: usize,
    /// Identities in etcd for (2).
    #[arg(long, default_value_t = 100_000)]
    identities: u32,
    /// Percent of them with no value key (unused).
    #[arg(long, default_value_t = 10)]
    unused_percent: u32,
    /// Keys per page of the GC's and the raw scan's range reads.
    #[arg(long, default_value_t = 5000)]
    page_size: i64,
    /// Interleaved raw-scan / GC round-1 pairs (medians reported).
    #[arg(long, default_value_t = 3)]
    scan_rounds: u32,
    /// The deletion rate limit of round 2 (raised from the default).
    #[arg(long, default_value_t = 100_000)]
    delete_qps: u32,
    /// Goal for the ratio (reported, not enforced).
    #[arg(long, default_value_t = 2.0)]
    goal_ratio: f64,
}

/// Runs the benchmark.
pub async fn run(args: &OperatorArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        args.nodes > 0 && args.nodes <= 2048 && args.api_concurrency > 0,
        "need 0 < --nodes <= 2048 (198.18.0.0/15 in /26 blocks) and --api-concurrency > 0"
    );
    anyhow::ensure!(
        args.identities > 0 && args.unused_percent <= 100 && args.page_size > 0 && args.scan_rounds > 0,
        "need --identities > 0, --unused-percent <= 100, --page-size > 0, --scan-rounds > 0"
    );
    let delete_qps = NonZeroU32::new(args.delete_qps).ok_or_else(|| anyhow::anyhow!("--delete-qps must be > 0"))?;
    let mut metrics = Vec::new();
    let join_ratio = nodes_joining(args, &mut metrics).await?;
    let ratio = identity_gc(args, delete_qps, &mut metrics).await?;
    metrics.push(("join_ratio".into(), join_ratio));
    metrics.push(("goal_ratio".into(), args.goal_ratio));
    metrics.push(("load_average".into(), load_average()?));
    Ok(BenchResult {
        name: "operator".into(),
        metrics,
        ratio,
    })
}

/// Creates Node `name` and its RivetNode (no pod CIDRs), as a joining
/// node's kubelet and svc-k8s-sync do.
async fn join(client: &Client, name: String) -> anyhow::Result<()> {
    let node: Node = serde_json::from_value(json!({ "metadata": { "name": name } }))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .map_err(|e| anyhow::anyhow!("creating Node {name}: {e}"))?;
    // Server-side apply as svc-k8s-sync in cluster-pool IPAM: without
    // spec.podCidrs, which the operator owns (forced, as svc-k8s-sync does:
    // the operator may have created it from the Node first).
    let apply = json!({
        "apiVersion": "rivet.io/v1", "kind": "RivetNode",
        "metadata": { "name": name },
        "spec": { "addresses": [{ "type": "InternalIP", "ip": "198.19.0.1" }] },
    });
    Api::<RivetNode>::all(client.clone())
        .patch(&name, &PatchParams::apply("svc-k8s-sync").force(), &Patch::Apply(apply))
        .await
        .map_err(|e| anyhow::anyhow!("applying RivetNode {name}: {e}"))?;
    Ok(())
}

/// Joins `names`, `concurrency` at a time.
async fn join_all(client: &Client, names: Vec<String>, concurrency: usize) -> anyhow::Result<()> {
    futures::stream::iter(names.into_iter().map(|n| join(client, n)))
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Part 1; returns join / creates.
async fn nodes_joining(args: &OperatorArgs, metrics: &mut Vec<(String, f64)>) -> anyhow::Result<f64> {
    let api = KubeApiServer::start().await?;
    api.apply_crds().await?;
    let client = api.admin_client();
    let names = |prefix: &str| (0..args.nodes).map(|i| format!("{prefix}-{i:04}")).collect::<Vec<_>>();

    // Peer: the API's own rate for the same objects, then removed.
    let started = Instant::now();
    tokio::time::timeout(STEP_TIMEOUT, join_all(&client, names("peer"), args.api_concurrency)).await??;
    let creates = started.elapsed();
    let all = ListParams::default();
    Api::<RivetNode>::all(client.clone())
        .delete_collection(&DeleteParams::default(), &all)
        .await?;
    Api::<Node>::all(client.clone())
        .delete_collection(&DeleteParams::default(), &all)
        .await?;

    // The duty's term, then the same joins on new names.
    let v4: Vec<IpNet> = vec!["198.18.0.0/15".parse()?];
    let v6: Vec<IpNet> = vec!["2001:2::/48".parse()?];
    let config = PoolConfig::new(&v4, 26, &v6, 64)?;
    let duty = ClusterPool::new(client.clone(), config, Duration::from_secs(300), PoolMetrics::default());
    let term = Term::begin("bench", 0, Instant::now() + Duration::from_secs(3600));
    let controllers = Controllers::new();
    let pool = duty.start_term(&term, &controllers);
    let started = Instant::now();
    let joined = async {
        join_all(&client, names("node"), args.api_concurrency).await?;
        let created = started.elapsed();
        pool.wait_all_allocated(args.nodes as usize).await;
        anyhow::Ok(created)
    };
    let created = tokio::time::timeout(STEP_TIMEOUT, joined).await??;
    let join_time = started.elapsed();
    controllers.shutdown().await;

    let nodes = f64::from(args.nodes);
    metrics.push(("nodes".into(), nodes));
    metrics.push(("join_s".into(), join_time.as_secs_f64()));
    metrics.push(("join_nodes_per_s".into(), nodes / join_time.as_secs_f64()));
    metrics.push(("join_creates_s".into(), created.as_secs_f64()));
    metrics.push(("peer_creates_s".into(), creates.as_secs_f64()));
    metrics.push(("peer_nodes_per_s".into(), nodes / creates.as_secs_f64()));
    Ok(join_time.as_secs_f64() / creates.as_secs_f64())
}

/// Fills etcd: a master per identity, a value key for the used ones.
async fn fill(etcd: &EtcdClient, layout: &Layout, args: &OperatorArgs) -> anyhow::Result<u32> {
    let unused_every = if args.unused_percent == 0 {
        u32::MAX
    } else {
        100 / args.unused_percent.max(1)
    };
    let mut ops = Vec::new();
    let mut unused = 0;
    for i in 0..args.identities {
        let id = FIRST_ID + i;
        let labels = format!("k8s:app=bench-{id}");
        ops.push(TxnOp::put(layout.id_key(id), labels.clone(), None));
        if i % unused_every == 0 {
            unused += 1;
        } else {
            let node = format!("node-{}", i % VALUE_NODES);
            ops.push(TxnOp::put(layout.value_key(&labels, &node), id.to_string(), None));
        }
    }
    let batches: Vec<Vec<TxnOp>> = ops.chunks(FILL_BATCH).map(<[TxnOp]>::to_vec).collect();
    futures::stream::iter(batches.into_iter().map(|batch| {
        let mut etcd = etcd.clone();
        async move { etcd.txn(Txn::new().and_then(batch)).await }
    }))
    .buffer_unordered(8)
    .try_collect::<Vec<_>>()
    .await?;
    Ok(unused)
}

/// The peer: the same keys as the GC's scan, read raw (paged, one
/// revision; value keys without values). Returns the keys read.
async fn raw_scan(etcd: &EtcdClient, layout: &Layout, page_size: i64) -> anyhow::Result<usize> {
    let mut etcd = etcd.clone();
    let mut keys = 0;
    let mut revision = 0;
    for (prefix, keys_only) in [(layout.value_root(), true), (layout.id_prefix(), false)] {
        let end = prefix_end(&prefix);
        let mut from = prefix.into_bytes();
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(page_size);
            if keys_only {
                options = options.with_keys_only();
            }
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let response = etcd.get(from.clone(), Some(options)).await?;
            if revision == 0 {
                revision = response.header().map_or(0, |h| h.revision());
            }
            keys += response.kvs().len();
            match response.kvs().last() {
                Some(last) if response.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
    }
    Ok(keys)
}

fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Part 2; returns GC round 1 / raw scan (medians).
async fn identity_gc(
    args: &OperatorArgs,
    delete_qps: NonZeroU32,
    metrics: &mut Vec<(String, f64)>,
) -> anyhow::Result<f64> {
    let server = EtcdServer::start_async().await?;
    let etcd = EtcdClient::connect([server.endpoint()], None).await?;
    let layout = Layout::default();
    let started = Instant::now();
    let unused = fill(&etcd, &layout, args).await?;
    let fill_time = started.elapsed();
    let term = Term::begin("bench", 0, Instant::now() + Duration::from_secs(3600));
    let new_gc = || {
        EtcdIdentityGc::new(
            etcd.clone(),
            layout.clone(),
            DeleteRate::per_second(delete_qps),
            IdentityGcMetrics::default(),
        )
        .with_page_size(args.page_size)
    };

    let (mut raw_ms, mut round1_ms) = (Vec::new(), Vec::new());
    let mut gc = new_gc();
    for _ in 0..args.scan_rounds {
        let started = Instant::now();
        let keys = raw_scan(&etcd, &layout, args.page_size).await?;
        raw_ms.push(ms(started.elapsed()));
        anyhow::ensure!(
            keys == (2 * args.identities - unused) as usize,
            "the raw scan read {keys} keys"
        );
        // A fresh GC each time: every measured round is a first (marking) round.
        gc = new_gc();
        let started = Instant::now();
        let report = tokio::time::timeout(STEP_TIMEOUT, gc.round(&term)).await??;
        round1_ms.push(ms(started.elapsed()));
        anyhow::ensure!(
            report.candidates == unused as usize && report.deleted == 0,
            "round 1 marked {} of {unused} unused identities and deleted {}",
            report.candidates,
            report.deleted
        );
    }
    let started = Instant::now();
    let report = tokio::time::timeout(STEP_TIMEOUT, gc.round(&term)).await??;
    let round2 = started.elapsed();
    anyhow::ensure!(
        report.deleted == unused as usize,
        "round 2 deleted {} of {unused} unused identities",
        report.deleted
    );

    let raw = percentile(&mut raw_ms, 0.5);
    let round1 = percentile(&mut round1_ms, 0.5);
    metrics.push(("identities".into(), f64::from(args.identities)));
    metrics.push(("unused".into(), f64::from(unused)));
    metrics.push(("fill_s".into(), fill_time.as_secs_f64()));
    metrics.push(("raw_scan_ms".into(), raw));
    metrics.push(("gc_round1_ms".into(), round1));
    metrics.push(("gc_round2_ms".into(), ms(round2)));
    metrics.push(("gc_deletes_per_s".into(), f64::from(unused) / round2.as_secs_f64()));
    Ok(round1 / raw)
}
