//! `ipam`: Allocate+Release pairs per second from 8 concurrent clients over
//! svc-ipam's Unix socket (the real binary), against the same operations on
//! an in-process `IpamStore` in the same run. Both write durably (fsync), so
//! the ratio (socket / in-process) is the cost of the process boundary.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rivet_common::grpc::{ClientOptions, connect_unix};
use rivet_common::testing::DaemonCommand;
use rivet_proto::ipam::v1 as pb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use svc_ipam::allocator::Owner;
use svc_ipam::events::IpamMetrics;
use svc_ipam::pool::{Family, PoolSet};
use svc_ipam::store::IpamStore;

use crate::report::{BenchResult, sibling_binary};

const CLIENTS: usize = 8;
const POOL: &str = "default=198.18.0.0/20";

/// Options of the ipam benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct IpamArgs {
    /// Allocate+Release pairs per client per round.
    #[arg(long, default_value_t = 300)]
    pairs: usize,
    /// Rounds; each measures both sides, interleaved, and the median is kept.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// Runs the benchmark.
pub async fn run(args: &IpamArgs) -> anyhow::Result<BenchResult> {
    let dir = tempfile::tempdir()?;
    let sockets = dir.path().join("sockets");
    let daemon = DaemonCommand::new(sibling_binary("svc-ipam")?, sockets.join("svc-ipam.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.path().join("daemon-state").as_os_str()])
        .args(["--pool", POOL])
        .env("RUST_LOG", "warn")
        .log_to(dir.path().join("svc-ipam.log"))
        .spawn()
        .await?;
    let store = Arc::new(IpamStore::open(
        &dir.path().join("inprocess-state"),
        PoolSet::new(&[POOL.parse()?])?,
        IpamMetrics::default(),
    )?);

    let mut grpc = Vec::new();
    let mut local = Vec::new();
    for round in 0..args.rounds {
        let g = over_socket(daemon.socket(), args.pairs, round).await?;
        let l = in_process(&store, args.pairs, round).await?;
        println!(
            "round {round}: socket {:.0} pairs/s, in-process {:.0} pairs/s",
            rate(args.pairs, g),
            rate(args.pairs, l)
        );
        grpc.push(rate(args.pairs, g));
        local.push(rate(args.pairs, l));
    }
    let grpc = median(grpc);
    let local = median(local);
    Ok(BenchResult {
        name: "ipam".into(),
        metrics: vec![
            ("grpc_pairs_per_s".into(), grpc),
            ("inprocess_pairs_per_s".into(), local),
            ("clients".into(), CLIENTS as f64),
        ],
        ratio: grpc / local,
    })
}

fn rate(pairs: usize, took: Duration) -> f64 {
    (pairs * CLIENTS) as f64 / took.as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn over_socket(socket: &std::path::Path, pairs: usize, round: usize) -> anyhow::Result<Duration> {
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(IpamClient::new(connect_unix(socket, &ClientOptions::default()).await?));
    }
    let started = Instant::now();
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, mut client)| {
            tokio::spawn(async move {
                for i in 0..pairs {
                    let owner = pb::Owner {
                        container_id: format!("r{round}-c{c}-{i}"),
                        interface: "eth0".into(),
                    };
                    client
                        .allocate(pb::AllocateRequest {
                            owner: Some(owner.clone()),
                            pool: String::new(),
                            family: pb::Family::Ipv4 as i32,
                            requested_address: Vec::new(),
                        })
                        .await?;
                    client.release(pb::ReleaseRequest { owner: Some(owner) }).await?;
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

async fn in_process(store: &Arc<IpamStore>, pairs: usize, round: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let store = store.clone();
            tokio::spawn(async move {
                for i in 0..pairs {
                    let owner = Owner {
                        container_id: format!("r{round}-c{c}-{i}"),
                        interface: "eth0".into(),
                    };
                    store.allocate(&owner, "default", Family::V4, None).await?;
                    store.release_owner(&owner).await?;
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
