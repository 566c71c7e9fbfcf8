//! `datapath`: iperf3 single-stream TCP pod→pod through Rivet's programs (with
//! policy entries enforced) against the same namespaces wired as plain veths
//! routed by the node's kernel without BPF, in one run (ratio = Rivet / plain;
//! goal ≥ 0.95). Plus ApplyEndpoint latency (p50/p99) for 200 new endpoints.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use rivet_common::testing::netns::{NetNs, TestNode};
use rivet_proto::loader::v1 as pb;
use svc_loader::testing::{HOST_PREFIX, LoaderNode, entry, pod_spec, policy};

use crate::report::{BenchResult, sibling_binary};

/// Options of the datapath benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct DatapathArgs {
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Rounds; each measures both sides, interleaved; the median is kept.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
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

    let mut with_rivet = Vec::new();
    let mut without = Vec::new();
    for round in 0..args.rounds {
        let r = iperf(
            &rivet.pod("a").ns,
            &rivet.pod("b").ns,
            rivet.pod("b").ipv4().unwrap(),
            args.seconds,
        )?;
        let p = iperf(
            &plain.pod("a").ns,
            &plain.pod("b").ns,
            plain.pod("b").ipv4().unwrap(),
            args.seconds,
        )?;
        println!(
            "round {round}: rivet {:.2} Gbit/s, plain veth {:.2} Gbit/s",
            r / 1e9,
            p / 1e9
        );
        with_rivet.push(r);
        without.push(p);
    }
    let rivet_bps = median(with_rivet);
    let plain_bps = median(without);

    let (p50, p99) = apply_latency(&rivet, args.endpoints).await?;
    println!(
        "ApplyEndpoint for {} new endpoints: p50 {p50:.2} ms, p99 {p99:.2} ms",
        args.endpoints
    );
    Ok(BenchResult {
        name: "datapath".into(),
        metrics: vec![
            ("rivet_gbit_per_s".into(), rivet_bps / 1e9),
            ("plain_veth_gbit_per_s".into(), plain_bps / 1e9),
            ("apply_endpoint_p50_ms".into(), p50),
            ("apply_endpoint_p99_ms".into(), p99),
        ],
        ratio: rivet_bps / plain_bps,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bits per second received by an iperf3 server in `server` from `client`.
fn iperf(client: &NetNs, server: &NetNs, dst: IpAddr, seconds: u32) -> anyhow::Result<f64> {
    let mut srv = server
        .command("iperf3")
        .args(["-s", "-1", "-p", "5201"])
        .stdout(std::process::Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = client
        .command("iperf3")
        .args(["-c", &dst.to_string(), "-p", "5201", "-J", "-t", &seconds.to_string()])
        .output()?;
    let _ = srv.wait();
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
    latencies.sort_by(f64::total_cmp);
    let pick = |q: f64| latencies[((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1];
    Ok((pick(0.50), pick(0.99)))
}
