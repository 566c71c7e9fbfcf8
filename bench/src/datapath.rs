//! `datapath`: iperf3 single-stream TCP pod→pod through Rivet's programs (with
//! policy entries enforced) against the same namespaces wired as plain veths
//! routed by the node's kernel without BPF, in one run. Plus ApplyEndpoint
//! latency (p50/p99) for 200 new endpoints.
//!
//! One iperf3 run is too noisy to steer by (the same build measured 1.01× on
//! an idle machine and 0.91× with the other core busy), so the two sides are
//! interleaved `--rounds` times (at least 5), the order flipping every round
//! (Rivet first, then plain first) so that a drift of the machine's load
//! weighs on both. Each round gives a ratio Rivet / plain of runs taken
//! seconds apart; the result is the median of those ratios, with their
//! minimum and maximum as the spread. `--busy-cores N` keeps N threads
//! spinning for the whole measurement (the "other core busy" case). The
//! 1-minute load average before and after is printed beside the figures.

use std::io::{BufRead as _, BufReader};
use std::net::IpAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rivet_common::testing::netns::{NetNs, TestNode};
use rivet_proto::loader::v1 as pb;
use rivet_testkit::loader::{HOST_PREFIX, LoaderNode, entry, pod_spec, policy};

use crate::report::{BenchResult, load_average, percentile, sibling_binary};

/// The fewest rounds that give a median worth the name.
const MIN_ROUNDS: usize = 5;

/// Options of the datapath benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct DatapathArgs {
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Rounds (at least 5); each measures both sides back to back, the
    /// order flipping every round.
    #[arg(long, default_value_t = MIN_ROUNDS)]
    rounds: usize,
    /// Threads kept spinning during the throughput rounds (1 on a 2-core
    /// machine: "the other core busy").
    #[arg(long, default_value_t = 0)]
    busy_cores: usize,
    /// Endpoints created for the ApplyEndpoint latency measurement.
    #[arg(long, default_value_t = 200)]
    endpoints: u32,
    /// Extra policy entries on the receiving pod (realistic policy size).
    #[arg(long, default_value_t = 100)]
    policy_entries: u32,
}

const A: u32 = 1001;

/// Runs the benchmark.
pub async fn run(args: &DatapathArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        args.rounds >= MIN_ROUNDS,
        "--rounds {} is too few: a median of fewer than {MIN_ROUNDS} interleaved rounds is as noisy as one run",
        args.rounds
    );
    let loader_bin = sibling_binary("svc-loader")?;
    let rivet = LoaderNode::start(&loader_bin, &["a", "b"], &[]).await?;
    let mut client = rivet.client().await;
    client
        .apply_endpoint(rivet.endpoint(
            "a",
            1,
            A,
            policy(
                1,
                false,
                true,
                vec![entry(
                    pb::Direction::Egress,
                    0,
                    pb::Protocol::Any,
                    0,
                    0,
                    pb::Verdict::Allow,
                )],
            ),
        ))
        .await?;
    let mut entries = vec![entry(
        pb::Direction::Ingress,
        A,
        pb::Protocol::Tcp,
        5201,
        0,
        pb::Verdict::Allow,
    )];
    for i in 0..args.policy_entries {
        entries.push(entry(
            pb::Direction::Ingress,
            2000 + i,
            pb::Protocol::Tcp,
            10000 + i,
            0,
            pb::Verdict::Allow,
        ));
    }
    client
        .apply_endpoint(rivet.endpoint("b", 2, 1002, policy(1, true, false, entries)))
        .await?;

    let mut plain = TestNode::new()?;
    plain.add_pod(pod_spec("a", 1).static_gateway_neighbor(true))?;
    plain.add_pod(pod_spec("b", 2).static_gateway_neighbor(true))?;

    let load_before = load_average()?;
    let busy = BusyThreads::start(args.busy_cores);
    let mut rounds = Vec::with_capacity(args.rounds);
    // Pods a and b of one side: a sends to b.
    let run = |node: &TestNode| {
        let (a, b) = (node.pod("a"), node.pod("b"));
        iperf(&a.ns, &b.ns, b.ipv4().expect("pod b has IPv4"), args.seconds)
    };
    for round in 0..args.rounds {
        let (r, p) = if round % 2 == 0 {
            let r = run(&rivet.node)?;
            (r, run(&plain)?)
        } else {
            let p = run(&plain)?;
            (run(&rivet.node)?, p)
        };
        println!(
            "round {round}: rivet {:.2} Gbit/s, plain veth {:.2} Gbit/s, ratio {:.3}",
            r / 1e9,
            p / 1e9,
            r / p
        );
        rounds.push(Round { rivet: r, plain: p });
    }
    drop(busy);
    let load_after = load_average()?;
    let summary = Summary::of(&rounds);
    println!(
        "{} rounds, {} busy threads: median ratio {:.3} (min {:.3}, max {:.3}); load average {load_before:.2} before, \
         {load_after:.2} after",
        rounds.len(),
        args.busy_cores,
        summary.ratio,
        summary.ratio_min,
        summary.ratio_max
    );

    let (p50, p99) = apply_latency(&rivet, args.endpoints).await?;
    println!(
        "ApplyEndpoint for {} new endpoints: p50 {p50:.2} ms, p99 {p99:.2} ms",
        args.endpoints
    );
    Ok(BenchResult {
        name: "datapath".into(),
        metrics: vec![
            ("rivet_gbit_per_s".into(), summary.rivet_bps / 1e9),
            ("plain_veth_gbit_per_s".into(), summary.plain_bps / 1e9),
            ("rounds".into(), rounds.len() as f64),
            ("busy_threads".into(), args.busy_cores as f64),
            ("ratio_min".into(), summary.ratio_min),
            ("ratio_max".into(), summary.ratio_max),
            ("load_average_1m_before".into(), load_before),
            ("load_average_1m_after".into(), load_after),
            ("apply_endpoint_p50_ms".into(), p50),
            ("apply_endpoint_p99_ms".into(), p99),
        ],
        ratio: summary.ratio,
    })
}

/// One round: bits per second of each side.
#[derive(Debug, Clone, Copy)]
struct Round {
    rivet: f64,
    plain: f64,
}

/// What the rounds say together.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Summary {
    /// Median of the per-round ratios Rivet / plain: the result.
    ratio: f64,
    /// The spread of the per-round ratios.
    ratio_min: f64,
    ratio_max: f64,
    /// Median throughput of each side.
    rivet_bps: f64,
    plain_bps: f64,
}

impl Summary {
    /// Summarises at least one round.
    fn of(rounds: &[Round]) -> Self {
        let ratios: Vec<f64> = rounds.iter().map(|r| r.rivet / r.plain).collect();
        Self {
            ratio: median(ratios.clone()),
            ratio_min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratio_max: ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            rivet_bps: median(rounds.iter().map(|r| r.rivet).collect()),
            plain_bps: median(rounds.iter().map(|r| r.plain).collect()),
        }
    }
}

/// The median (the mean of the middle two for an even count).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Threads spinning until dropped.
struct BusyThreads {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BusyThreads {
    fn start(count: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..count)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for BusyThreads {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Bits per second received by an iperf3 server in `server` from `client`.
pub(crate) fn iperf(client: &NetNs, server: &NetNs, dst: IpAddr, seconds: u32) -> anyhow::Result<f64> {
    iperf_with(client, server, dst, seconds, |_| Ok(()))
}

/// [`iperf`] with the client's command set up by `prepare` first (e.g. made
/// to join a cgroup).
pub(crate) fn iperf_with(
    client: &NetNs,
    server: &NetNs,
    dst: IpAddr,
    seconds: u32,
    prepare: impl FnOnce(&mut std::process::Command) -> std::io::Result<()>,
) -> anyhow::Result<f64> {
    let mut srv = server
        .command("iperf3")
        .args(["-s", "-1", "-p", "5201", "--forceflush"])
        .stdout(Stdio::piped())
        .spawn()?;
    // Listening once it says so (a probe connection would be its one client).
    let mut lines = BufReader::new(srv.stdout.take().expect("stdout is piped")).lines();
    let listening = lines
        .by_ref()
        .any(|l| l.is_ok_and(|l| l.starts_with("Server listening")));
    if !listening {
        let _ = srv.kill();
        let _ = srv.wait();
        anyhow::bail!("iperf3 -s in {} exited before listening", server.name());
    }
    let drain = std::thread::spawn(move || lines.for_each(drop));
    let mut command = client.command("iperf3");
    command.args(["-c", &dst.to_string(), "-p", "5201", "-J", "-t", &seconds.to_string()]);
    let out = prepare(&mut command).and_then(|()| command.output());
    if out.as_ref().map_or(true, |o| !o.status.success()) {
        let _ = srv.kill();
    }
    let _ = srv.wait();
    let _ = drain.join();
    let out = out?;
    anyhow::ensure!(
        out.status.success(),
        "iperf3 failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    json["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("no bits_per_second in iperf3's output"))
}

/// ApplyEndpoint latency for `count` new endpoints on fresh veths.
async fn apply_latency(node: &LoaderNode, count: u32) -> anyhow::Result<(f64, f64)> {
    let ns = &node.node.ns;
    let mut client = node.client().await;
    let mut latencies = Vec::new();
    for i in 0..count {
        let host = format!("{HOST_PREFIX}b{i}");
        ns.ip(&["link", "add", &host, "type", "veth", "peer", "name", &format!("rvp{i}")])?;
        ns.ip(&["link", "set", &host, "up"])?;
        let ifindex = ns.ifindex(&host)?;
        let request = pb::ApplyEndpointRequest {
            endpoint_id: 100 + i,
            host_ifindex: ifindex,
            addresses: vec![vec![198, 18, 10 + (i / 250) as u8, (i % 250) as u8 + 2]],
            mac: vec![0x02, 0, 0, 0, (i >> 8) as u8, i as u8],
            identity: 3000 + i,
            policy: Some(policy(
                1,
                true,
                true,
                vec![entry(
                    pb::Direction::Ingress,
                    A,
                    pb::Protocol::Tcp,
                    80,
                    0,
                    pb::Verdict::Allow,
                )],
            )),
        };
        let started = Instant::now();
        client.apply_endpoint(request).await?;
        latencies.push(started.elapsed().as_secs_f64() * 1e3);
    }
    Ok((percentile(&mut latencies, 0.50), percentile(&mut latencies, 0.99)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_is_the_median_of_per_round_ratios_with_their_spread() {
        let rounds = [
            Round {
                rivet: 10.0,
                plain: 10.0,
            },
            Round {
                rivet: 9.0,
                plain: 10.0,
            },
            Round {
                rivet: 12.0,
                plain: 10.0,
            },
            Round {
                rivet: 22.0,
                plain: 20.0,
            },
            Round {
                rivet: 5.0,
                plain: 10.0,
            },
        ];
        let s = Summary::of(&rounds);
        assert_eq!(s.ratio, 1.0);
        assert_eq!((s.ratio_min, s.ratio_max), (0.5, 1.2));
        assert_eq!((s.rivet_bps, s.plain_bps), (10.0, 10.0));
    }

    #[test]
    fn median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
