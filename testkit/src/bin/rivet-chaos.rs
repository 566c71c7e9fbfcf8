//! `rivet-chaos`: the chaos run of [`rivet_testkit::chaos`] for people
//! (`cargo xtask chaos` builds and runs it): a `rivet cluster up` of 2 or 3
//! nodes churned for `--minutes` with pod adds and deletes, policies,
//! kill -9 of node daemons and etcd restarts, Rivet's invariants checked
//! throughout and at the end. Prints each violation with the seed and step
//! as it is found, then a summary; exits 1 when there was any violation.
//!
//! Needs root, a bpffs, the rivet users and etcd 3.6 (`cargo xtask
//! install`) and the workspace binaries beside it (`cargo build --bins`).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::Parser;
use rivet_testkit::chaos::{self, ChaosOptions};
use rivet_testkit::cluster::Routing;

/// Randomised churn on a multi-node Rivet cluster, with Rivet's invariants
/// checked throughout and nothing left at the end.
#[derive(Debug, Parser)]
#[command(name = "rivet-chaos", version, about)]
struct Cli {
    /// Minutes of churn (the end's checks come after).
    #[arg(long, default_value_t = 10)]
    minutes: u64,
    /// Seconds of churn instead of minutes (short runs).
    #[arg(long, conflicts_with = "minutes")]
    seconds: Option<u64>,
    /// Seed of every choice; default: from the clock (printed first).
    #[arg(long)]
    seed: Option<u64>,
    /// Nodes: 2 or 3.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(2..=3))]
    nodes: u64,
    /// Churned pods live at most at once.
    #[arg(long, default_value_t = 200)]
    max_pods: usize,
    /// Pairs probed per check.
    #[arg(long, default_value_t = 4)]
    probes: usize,
    /// How pod traffic crosses nodes.
    #[arg(long, value_enum, default_value_t = Routing::Native)]
    routing: Routing,
    /// Copy the cluster's logs (daemons, etcd) here when there was a violation.
    #[arg(long, value_name = "DIR")]
    keep_logs: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// Whether the run found no violation.
fn run(cli: Cli) -> Result<bool> {
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    println!("rivet-chaos: seed {seed} (replay with --seed {seed})");
    let bin_dir = std::env::current_exe()
        .context("locating rivet-chaos")?
        .parent()
        .map(std::path::Path::to_path_buf)
        .context("the directory of rivet-chaos")?;
    let mut options = ChaosOptions::long(seed, cli.minutes);
    if let Some(seconds) = cli.seconds {
        options.duration = Duration::from_secs(seconds);
    }
    options.nodes = usize::try_from(cli.nodes).context("--nodes")?;
    options.max_pods = cli.max_pods;
    options.probes_per_check = cli.probes;
    options.routing = cli.routing;
    options.bin_dir = Some(bin_dir);
    options.keep_logs = cli.keep_logs;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let summary = runtime.block_on(chaos::run(&options))?;
    println!("{summary}");
    Ok(summary.violations.is_empty())
}
