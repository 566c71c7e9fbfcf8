//! `identity`: identity allocations per second from 8 concurrent clients
//! over the Unix socket of the real svc-identity, backed by a real local
//! etcd, against the limit etcd sets: raw compare-and-swap transactions per
//! second of the same shape as an identity creation, from 8 concurrent
//! etcd-client tasks on the same etcd in the same run.
//!
//! Per round (rounds interleaved, medians kept):
//! - new: label sets never seen (`k8s:app=bench-<round>-<client>-<i>` plus
//!   `k8s:io.kubernetes.pod.namespace=bench`); each costs the daemon a store
//!   round trip to find an existing holder and the creating transaction;
//! - cached: the sets this node already holds, allocated again (never
//!   touches etcd: the process boundary plus the allocator's bookkeeping);
//! - raw CAS: `create_revision(id key) == 0 AND create_revision(value
//!   prefix) == 0 → put the id key, put the value key (on a lease)`, the
//!   creating transaction itself, on fresh keys under a separate prefix.
//!
//! ratio = new allocations/s ÷ raw CAS transactions/s (the goal is ≥ 0.5).

use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::DaemonCommand;
use rivet_common::testing::etcd::EtcdServer;
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;

use crate::report::{BenchResult, sibling_binary};

const CLIENTS: usize = 8;
const NODE: &str = "bench-node";
const NAMESPACE_LABEL: &str = "k8s:io.kubernetes.pod.namespace=bench";
/// The raw transactions' keys: apart from the daemon's (`rivet/state/`).
const CAS_PREFIX: &str = "rivet-bench/cas/identities/v1/";
/// TTL of the raw side's lease (the daemon's default is 15 s; it keeps its
/// lease alive, this one only has to outlive the run).
const CAS_LEASE_TTL_SECS: i64 = 300;

/// Options of the identity benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct IdentityArgs {
    /// New label sets per client per round (also the raw transactions per
    /// client per round).
    #[arg(long, default_value_t = 100)]
    per_client: usize,
    /// How many times each client re-allocates its round's sets for the
    /// cached measurement (cached allocations are much faster than new ones).
    #[arg(long, default_value_t = 10)]
    cached_passes: usize,
    /// Rounds; each measures every side, interleaved, and the median is kept.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

type Identity = IdentityServiceClient<DaemonChannel>;

/// Runs the benchmark.
pub async fn run(args: &IdentityArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        args.rounds > 0 && args.per_client > 0 && args.cached_passes > 0,
        "--rounds, --per-client and --cached-passes must be positive"
    );
    let etcd = tokio::task::spawn_blocking(EtcdServer::start).await??;
    let dir = tempfile::tempdir()?;
    let sockets = dir.path().join("sockets");
    let daemon = DaemonCommand::new(sibling_binary("svc-identity")?, sockets.join("svc-identity.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.path().join("state").as_os_str()])
        .args(["--node-name", NODE])
        .args(["--etcd-endpoints", &etcd.endpoint()])
        .env("RUST_LOG", "warn")
        .log_to(dir.path().join("svc-identity.log"))
        .spawn()
        .await?;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(IdentityServiceClient::new(
            connect_unix(daemon.socket(), &ClientOptions::default()).await?,
        ));
    }
    // One connection shared by the raw tasks, as the daemon shares one.
    let etcd_client = Client::connect([etcd.endpoint()], None).await?;
    let lease = etcd_client.clone().lease_grant(CAS_LEASE_TTL_SECS, None).await?.id();

    // Warm-up, not measured: the daemon's first listing of the store, the
    // connections, etcd's first writes.
    let warm = 10;
    allocate_new(&clients, "warmup", warm).await?;
    raw_cas(&etcd_client, lease, "warmup", warm).await?;

    let ops = CLIENTS * args.per_client;
    let (mut new, mut cached, mut cas) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let tag = round.to_string();
        // Alternate which side meets the (slowly growing) store first.
        let (n, c) = if round % 2 == 1 {
            let c = raw_cas(&etcd_client, lease, &tag, args.per_client).await?;
            (allocate_new(&clients, &tag, args.per_client).await?, c)
        } else {
            let n = allocate_new(&clients, &tag, args.per_client).await?;
            (n, raw_cas(&etcd_client, lease, &tag, args.per_client).await?)
        };
        let h = allocate_cached(&clients, &tag, args.per_client, args.cached_passes).await?;
        let (n, h, c) = (rate(ops, n), rate(ops * args.cached_passes, h), rate(ops, c));
        println!("round {round}: new {n:.0} allocations/s, cached {h:.0} allocations/s, raw CAS {c:.0} txn/s");
        new.push(n);
        cached.push(h);
        cas.push(c);
    }
    drop(daemon);
    drop(etcd);
    let (new, cached, cas) = (median(new), median(cached), median(cas));
    Ok(BenchResult {
        name: "identity".into(),
        metrics: vec![
            ("new_allocations_per_s".into(), new),
            ("cached_allocations_per_s".into(), cached),
            ("raw_cas_txn_per_s".into(), cas),
        ],
        ratio: new / cas,
    })
}

fn rate(ops: usize, took: Duration) -> f64 {
    ops as f64 / took.as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Label set `i` of client `c` in round `tag`.
fn labels(tag: &str, c: usize, i: usize) -> Vec<String> {
    vec![format!("k8s:app=bench-{tag}-{c}-{i}"), NAMESPACE_LABEL.to_string()]
}

async fn allocate(client: &mut Identity, labels: Vec<String>) -> anyhow::Result<pb::AllocateIdentityResponse> {
    Ok(client
        .allocate_identity(pb::AllocateIdentityRequest {
            labels,
            owner: String::new(),
        })
        .await?
        .into_inner())
}

/// Each client allocates `per_client` label sets never seen before.
async fn allocate_new(clients: &[Identity], tag: &str, per_client: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let tasks: Vec<_> = clients
        .iter()
        .cloned()
        .enumerate()
        .map(|(c, mut client)| {
            let tag = tag.to_string();
            tokio::spawn(async move {
                for i in 0..per_client {
                    let r = allocate(&mut client, labels(&tag, c, i)).await?;
                    anyhow::ensure!(r.newly_allocated, "label set {tag}-{c}-{i} was not new: {r:?}");
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed())
}

/// Each client allocates its `per_client` sets of round `tag` again,
/// `passes` times over.
async fn allocate_cached(
    clients: &[Identity],
    tag: &str,
    per_client: usize,
    passes: usize,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let tasks: Vec<_> = clients
        .iter()
        .cloned()
        .enumerate()
        .map(|(c, mut client)| {
            let tag = tag.to_string();
            tokio::spawn(async move {
                for _ in 0..passes {
                    for i in 0..per_client {
                        let r = allocate(&mut client, labels(&tag, c, i)).await?;
                        anyhow::ensure!(!r.newly_allocated, "label set {tag}-{c}-{i} was new again: {r:?}");
                    }
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed())
}

/// `per_client` creating transactions from each of 8 tasks on fresh keys.
async fn raw_cas(client: &Client, lease: i64, tag: &str, per_client: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let mut kv = client.kv_client();
            let tag = tag.to_string();
            tokio::spawn(async move {
                for i in 0..per_client {
                    let labels = labels(&tag, c, i).join(",");
                    let id_key = format!("{CAS_PREFIX}id/{tag}-{c}-{i}");
                    let value_prefix = format!("{CAS_PREFIX}value/{labels}/");
                    let txn = Txn::new()
                        .when([
                            Compare::create_revision(id_key.clone(), CompareOp::Equal, 0),
                            Compare::create_revision(value_prefix.clone(), CompareOp::Equal, 0).with_prefix(),
                        ])
                        .and_then([
                            TxnOp::put(id_key.clone(), labels.as_str(), None),
                            TxnOp::put(
                                format!("{value_prefix}{NODE}"),
                                "1",
                                Some(PutOptions::new().with_lease(lease)),
                            ),
                        ])
                        .or_else([
                            TxnOp::get(value_prefix, Some(GetOptions::new().with_prefix().with_limit(1))),
                            TxnOp::get(id_key, None),
                        ]);
                    let resp = kv.txn(txn).await?;
                    anyhow::ensure!(resp.succeeded(), "raw CAS on fresh keys {tag}-{c}-{i} failed");
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed())
}
