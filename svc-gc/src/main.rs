//! svc-gc: flags and wiring; the logic lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use prometheus_client::registry::Registry;
use rivet_common::config::{self, CommonArgs};
use rivet_common::controller::Controllers;
use rivet_common::daemon;
use rivet_common::grpc::DaemonIdentity;
use rivet_common::metrics::Health;
use rivet_common::privileges::Dropped;
use rivet_datapath::maps::CtTimeouts;
use rivet_datapath::pin;
use svc_gc::classify::Timeouts;
use svc_gc::clock::KernelClock;
use svc_gc::collector::{Collector, CollectorOptions};
use svc_gc::endpoints::GrpcEndpoints;
use svc_gc::events::GcMetrics;
use svc_gc::interval::IntervalBounds;
use svc_gc::map::BatchMode;
use svc_gc::pass::GcMaps;
use svc_gc::service::GcService;
use tonic::service::Routes;

/// Rivet's conntrack garbage collector.
#[derive(Debug, Parser)]
#[command(name = "svc-gc", version, about)]
struct Flags {
    #[command(flatten)]
    common: CommonArgs,

    /// Mount point of the BPF filesystem; the maps are `<bpffs>/rivet/<node-name>/ct4` and `ct6`
    /// (the pin layout of `rivet_common::pin_layout`, which svc-loader creates).
    #[arg(long, env = "RIVET_BPFFS", default_value = pin::DEFAULT_BPFFS)]
    bpffs: PathBuf,

    /// Idle timeout of a TCP connection being opened, seconds (same flag and variable as svc-loader's
    /// datapath lifetime).
    #[arg(long, env = "RIVET_CT_TCP_SYN_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.tcp_syn)]
    ct_tcp_syn_timeout: u32,
    /// Idle timeout of an established TCP connection, seconds.
    #[arg(long, env = "RIVET_CT_TCP_ESTABLISHED_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.tcp_established)]
    ct_tcp_established_timeout: u32,
    /// Idle timeout of a closing TCP connection, seconds.
    #[arg(long, env = "RIVET_CT_TCP_CLOSING_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.tcp_closing)]
    ct_tcp_closing_timeout: u32,
    /// Idle timeout of a UDP flow (and of other protocols), seconds.
    #[arg(long, env = "RIVET_CT_UDP_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.udp)]
    ct_udp_timeout: u32,
    /// Idle timeout of an ICMP flow, seconds.
    #[arg(long, env = "RIVET_CT_ICMP_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.icmp)]
    ct_icmp_timeout: u32,

    /// Interval after the initial pass, before it adapts, seconds.
    #[arg(long, env = "RIVET_GC_START_INTERVAL_SECONDS", default_value_t = 300.0)]
    start_interval_seconds: f64,
    /// Shortest interval between scheduled passes, seconds (also the least time between map-pressure passes).
    #[arg(long, env = "RIVET_GC_MIN_INTERVAL_SECONDS", default_value_t = 10.0)]
    min_interval_seconds: f64,
    /// Longest interval between scheduled passes, seconds.
    #[arg(long, env = "RIVET_GC_MAX_INTERVAL_SECONDS", default_value_t = 1800.0)]
    max_interval_seconds: f64,

    /// Fill of a map (share of its max_entries) that starts a pass early; 1 or more disables.
    #[arg(long, env = "RIVET_GC_PRESSURE_THRESHOLD", default_value_t = 0.8)]
    pressure_threshold: f64,
    /// How often the maps' fill is estimated (a sample, not a scan), seconds.
    #[arg(long, env = "RIVET_GC_PRESSURE_CHECK_SECONDS", default_value_t = 5.0)]
    pressure_check_seconds: f64,

    /// Use per-element map commands only (no BPF_MAP_*_BATCH): for kernels or tools that misbehave with
    /// batches. Batches are otherwise used and fall back by themselves when the kernel refuses them.
    #[arg(long, env = "RIVET_GC_PER_ENTRY_MAP_OPS")]
    per_entry_map_ops: bool,

    /// Deadline of svc-endpoint's ListEndpoints per pass, seconds (on failure the pass deletes no orphans).
    #[arg(long, env = "RIVET_GC_ENDPOINT_LIST_TIMEOUT_SECONDS", default_value_t = 5.0)]
    endpoint_list_timeout_seconds: f64,
}

fn seconds(name: &str, value: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        value.is_finite() && value >= 0.0,
        "--{name} must be a number of seconds ≥ 0"
    );
    Ok(Duration::from_secs_f64(value))
}

fn options(flags: &Flags) -> anyhow::Result<CollectorOptions> {
    let min = seconds("min-interval-seconds", flags.min_interval_seconds)?;
    let max = seconds("max-interval-seconds", flags.max_interval_seconds)?;
    let start = seconds("start-interval-seconds", flags.start_interval_seconds)?;
    anyhow::ensure!(
        min >= Duration::from_millis(100),
        "--min-interval-seconds must be at least 0.1"
    );
    anyhow::ensure!(
        max >= min,
        "--max-interval-seconds must not be below --min-interval-seconds"
    );
    anyhow::ensure!(
        flags.pressure_threshold.is_finite() && flags.pressure_threshold > 0.0,
        "--pressure-threshold must be above 0"
    );
    let secs = |s: u32| Duration::from_secs(u64::from(s));
    Ok(CollectorOptions {
        timeouts: Timeouts {
            tcp_syn: secs(flags.ct_tcp_syn_timeout),
            tcp_established: secs(flags.ct_tcp_established_timeout),
            tcp_closing: secs(flags.ct_tcp_closing_timeout),
            udp: secs(flags.ct_udp_timeout),
            icmp: secs(flags.ct_icmp_timeout),
        },
        start_interval: start.clamp(min, max),
        bounds: IntervalBounds { min, max },
        pressure_threshold: flags.pressure_threshold,
        pressure_check: seconds("pressure-check-seconds", flags.pressure_check_seconds)?,
        retry: Duration::from_secs(2),
    })
}

fn main() -> ExitCode {
    let flags: Flags = config::load();
    // Before any thread starts: the allocator hands out arenas per thread.
    if let Err(e) = rivet_common::malloc::tune_for_daemon() {
        return daemon::exit(svc_gc::DAEMON_NAME, Err(e));
    }
    // First, before the runtime starts threads: credentials are per thread.
    let privileges = daemon::drop_privileges(&flags.common, svc_gc::DAEMON_NAME, svc_gc::CAPABILITIES);
    daemon::exit(
        svc_gc::DAEMON_NAME,
        privileges.map_err(anyhow::Error::from).and_then(|p| run(flags, p)),
    )
}

#[tokio::main]
async fn run(flags: Flags, privileges: Dropped) -> anyhow::Result<()> {
    let identity = DaemonIdentity::new(svc_gc::DAEMON_NAME, env!("CARGO_PKG_VERSION"), flags.common.node_name());
    let _telemetry = daemon::init_telemetry(&flags.common, &identity)?;
    privileges.log();
    let opts = options(&flags)?;
    let node = flags.common.node_name();
    let pin_dir = pin::pin_dir(&flags.bpffs, &node)?;
    let list_timeout = seconds("endpoint-list-timeout-seconds", flags.endpoint_list_timeout_seconds)?;
    let listener = daemon::bind_socket(&flags.common, svc_gc::DAEMON_NAME, svc_gc::READ_ONLY_METHODS)?;

    let mode = if flags.per_entry_map_ops {
        BatchMode::Never
    } else {
        BatchMode::Auto
    };
    let endpoints = Arc::new(GrpcEndpoints::new(
        &flags.common.socket_path("svc-endpoint"),
        list_timeout,
    ));
    let metrics = GcMetrics::default();
    let mut registry = Registry::with_prefix("rivet");
    metrics.register(&mut registry);
    tracing::info!(
        pin_dir = %pin_dir.display(),
        timeouts = ?opts.timeouts,
        min_interval_s = opts.bounds.min.as_secs_f64(),
        max_interval_s = opts.bounds.max.as_secs_f64(),
        "starting; maps are opened at the first pass (and reopened if their pins change)"
    );
    let collector = Collector::new(
        opts,
        GcMaps::pinned(&pin_dir, mode),
        endpoints,
        Arc::new(KernelClock::new()),
        metrics,
    );
    let controllers = Controllers::new();
    collector.start(&controllers);

    let service = GcService::new(collector, identity.boot_id.clone());
    let routes = Routes::new(service.into_server());
    daemon::run(
        &flags.common,
        listener,
        identity,
        controllers,
        routes,
        registry,
        Health::default(),
    )
    .await
    .context("serving")?;
    Ok(())
}
