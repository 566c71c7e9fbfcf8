//! `gc`: svc-gc (release build, the real process) over the datapath's real
//! conntrack map, pinned in a test bpffs directory:
//!
//! 1. a full pass (RunNow) over `--entries` established-TCP entries of which
//!    `--expired-percent` are expired, against a raw `BPF_MAP_LOOKUP_BATCH`
//!    dump of the same map, freshly refilled, in the same run: the least any
//!    pass that reads every entry costs. Rounds alternate refill → dump →
//!    pass; ratio = the median over rounds of pass / dump, each pass paired
//!    with the dump just before it (so load from elsewhere on the machine
//!    mostly cancels out); lower is better, goal ≤ 2.0. The pass time is
//!    svc-gc's own (`duration_nanos`); the RunNow round trip, medians and
//!    minimums are reported beside it.
//! 2. steady state: `--steady-entries` live entries in a map of the default
//!    size, svc-gc running with its interval pinned at `--steady-interval`
//!    (default 10 s, the floor: the busiest a quiet node gets) and the
//!    default map-pressure checks (a sample every 5 s); its CPU time
//!    (utime + stime of the process) over `--steady-seconds`, per minute.

use std::os::fd::AsFd as _;
use std::time::{Duration, Instant};

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::DaemonProcess;
use rivet_proto::gc::v1 as pb;
use rivet_proto::gc::v1::gc_service_client::GcServiceClient;
use rivet_testkit::gc::{TestMaps, daemon_command, synthetic_entries};
use svc_gc::clock::{Clock as _, KernelClock};
use svc_gc::sys;
use svc_loader::maps::{Ct4Key, CtEntry};

use crate::procfs::cpu_seconds;
use crate::report::{BenchResult, sibling_binary};

/// Options of the gc benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct GcArgs {
    /// Entries in the map for the pass measurement.
    #[arg(long, default_value_t = 1_000_000)]
    entries: u32,
    /// Share of them expired, percent.
    #[arg(long, default_value_t = 10)]
    expired_percent: u32,
    /// Rounds of refill, dump, pass.
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Live entries for the steady-state CPU measurement.
    #[arg(long, default_value_t = 100_000)]
    steady_entries: u32,
    /// Seconds of steady state measured.
    #[arg(long, default_value_t = 60)]
    steady_seconds: u64,
    /// svc-gc's interval during the steady state, seconds.
    #[arg(long, default_value_t = 10)]
    steady_interval: u64,
}

/// Entries read per raw batch call (the most a single call can return is
/// the whole map; bigger chunks only save syscalls).
const RAW_CHUNK: usize = 65_536;

/// A full dump with `BPF_MAP_LOOKUP_BATCH`; returns the entries read.
fn raw_dump(pin: &std::path::Path) -> anyhow::Result<usize> {
    let fd = sys::obj_get(pin)?;
    let mut keys: Vec<Ct4Key> = Vec::with_capacity(RAW_CHUNK);
    let mut values: Vec<CtEntry> = Vec::with_capacity(RAW_CHUNK);
    let mut token = None;
    let mut total = 0;
    loop {
        let read = sys::lookup_batch(fd.as_fd(), token, &mut keys, &mut values, RAW_CHUNK)?;
        total += read.count;
        if read.done {
            return Ok(total);
        }
        token = Some(read.next);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn client(daemon: &DaemonProcess) -> anyhow::Result<GcServiceClient<DaemonChannel>> {
    let options = ClientOptions {
        request_timeout: Duration::from_secs(120),
        ..ClientOptions::default()
    };
    Ok(GcServiceClient::new(connect_unix(daemon.socket(), &options).await?))
}

async fn wait_passes(daemon: &DaemonProcess, n: u64) -> anyhow::Result<pb::StatusResponse> {
    let started = Instant::now();
    loop {
        let s = client(daemon).await?.status(pb::StatusRequest {}).await?.into_inner();
        if s.passes >= n {
            return Ok(s);
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(120), "svc-gc ran no pass");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs the benchmark.
pub async fn run(args: &GcArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(args.rounds > 0 && args.entries > 0, "nothing to measure");
    let bin = sibling_binary("svc-gc")?;
    let clock = KernelClock::new();
    let expired = args.entries / 100 * args.expired_percent.min(100);
    let live = args.entries - expired;

    // 1. Pass vs raw dump.
    let maps = TestMaps::create("bench", args.entries + args.entries / 4, 64)?;
    let dir = tempfile::tempdir()?;
    // No scheduled or map-pressure pass: only RunNow.
    let daemon = daemon_command(
        &bin,
        dir.path(),
        &maps.node_name,
        &[
            "--start-interval-seconds",
            "86400",
            "--min-interval-seconds",
            "86400",
            "--max-interval-seconds",
            "86400",
            "--pressure-threshold",
            "1",
        ],
    )
    .spawn()
    .await?;
    wait_passes(&daemon, 1).await?;
    let mut ct4 = maps.ct4();
    let pin = maps.pin_dir().join("ct4");
    let (mut dumps, mut passes, mut round_trips, mut ratios) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut batched = true;
    for round in 0..args.rounds {
        let (keys, values) = synthetic_entries(clock.monotonic_nanos(), live, expired, 21_600);
        ct4.insert_all(&keys, &values)?;
        let started = Instant::now();
        let n = raw_dump(&pin)?;
        let dump = started.elapsed();
        anyhow::ensure!(n == args.entries as usize, "the dump read {n} entries");

        let started = Instant::now();
        let response = client(&daemon).await?.run_now(pb::RunNowRequest {}).await?.into_inner();
        let round_trip = started.elapsed();
        let pass = response
            .pass
            .ok_or_else(|| anyhow::anyhow!("RunNow returned no pass"))?;
        let deleted = pass.deleted.unwrap_or_default();
        anyhow::ensure!(
            pass.scanned == u64::from(args.entries) && deleted.expired == u64::from(expired),
            "the pass scanned {} and deleted {} (expected {} and {expired})",
            pass.scanned,
            deleted.expired,
            args.entries
        );
        batched &= pass.maps.iter().all(|m| m.batched || m.scanned == 0);
        let pass_time = Duration::from_nanos(pass.duration_nanos);
        println!(
            "round {round}: raw dump {:.1} ms, pass {:.1} ms (RunNow round trip {:.1} ms), ratio {:.2}",
            dump.as_secs_f64() * 1e3,
            pass_time.as_secs_f64() * 1e3,
            round_trip.as_secs_f64() * 1e3,
            pass_time.as_secs_f64() / dump.as_secs_f64()
        );
        ratios.push(pass_time.as_secs_f64() / dump.as_secs_f64());
        dumps.push(dump.as_secs_f64() * 1e3);
        passes.push(pass_time.as_secs_f64() * 1e3);
        round_trips.push(round_trip.as_secs_f64() * 1e3);
    }
    drop(daemon);
    drop(ct4);
    drop(maps);
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (dump_min_ms, pass_min_ms) = (min(&dumps), min(&passes));
    let (dump_ms, pass_ms, round_trip_ms) = (median(dumps), median(passes), median(round_trips));
    let ratio = median(ratios);

    // 2. Steady state.
    let maps = TestMaps::create("steady", 786_432, 786_432)?;
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), args.steady_entries, 0, 21_600);
    maps.ct4().insert_all(&keys, &values)?;
    let interval = args.steady_interval.to_string();
    let daemon = daemon_command(
        &bin,
        dir.path(),
        &maps.node_name,
        &[
            "--start-interval-seconds",
            &interval,
            "--min-interval-seconds",
            &interval,
            "--max-interval-seconds",
            &interval,
        ],
    )
    .spawn()
    .await?;
    let before = wait_passes(&daemon, 1).await?;
    let pid = daemon.pid().ok_or_else(|| anyhow::anyhow!("svc-gc is not running"))?;
    let cpu_before = cpu_seconds(pid)?;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.steady_seconds)).await;
    let cpu = cpu_seconds(pid)? - cpu_before;
    let elapsed = started.elapsed();
    let after = client(&daemon).await?.status(pb::StatusRequest {}).await?.into_inner();
    let steady_passes = after.passes - before.passes;
    let last = after.last_pass.unwrap_or_default();
    let cpu_per_min = cpu * 60.0 / elapsed.as_secs_f64();
    println!(
        "steady state: {} live entries, {steady_passes} passes of ~{:.1} ms in {:.0} s, {:.3} CPU s ({:.4} CPU s/min)",
        args.steady_entries,
        last.duration_nanos as f64 / 1e6,
        elapsed.as_secs_f64(),
        cpu,
        cpu_per_min
    );

    Ok(BenchResult {
        name: "gc".into(),
        metrics: vec![
            ("entries".into(), f64::from(args.entries)),
            ("expired".into(), f64::from(expired)),
            ("pass_ms".into(), pass_ms),
            ("raw_dump_ms".into(), dump_ms),
            ("pass_min_ms".into(), pass_min_ms),
            ("raw_dump_min_ms".into(), dump_min_ms),
            ("run_now_round_trip_ms".into(), round_trip_ms),
            ("batched".into(), if batched { 1.0 } else { 0.0 }),
            ("steady_entries".into(), f64::from(args.steady_entries)),
            ("steady_interval_s".into(), args.steady_interval as f64),
            ("steady_passes".into(), steady_passes as f64),
            ("steady_pass_ms".into(), last.duration_nanos as f64 / 1e6),
            ("cpu_s_per_min".into(), cpu_per_min),
        ],
        ratio,
    })
}
