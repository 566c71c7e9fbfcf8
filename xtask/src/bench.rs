//! `cargo xtask bench <name>`: run one benchmark of the `bench/` crate.
//!
//! The benchmarks live in the `rivet-bench` binary, which takes the benchmark name and
//! prints its `RESULT ...` line itself; this only builds it with the `bench-release`
//! profile (optimised, with line tables for profiling) in one workspace build and runs
//! that binary with the arguments. `cluster` is the exception: it measures the binaries
//! of the image it is given, running in a kubelet cluster; the local binary only applies
//! objects and watches them, so the dev build does (no minutes of optimised rebuild).
//! `--dev` runs any benchmark on the dev build: unoptimised daemons, so its times are
//! not the figures of record and its memory figures are upper bounds.

use anyhow::Result;

use crate::cmd;

/// Arguments of `cargo xtask bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// List the benchmarks instead of running one.
    #[arg(long, conflicts_with = "name")]
    list: bool,
    /// Build and run the dev profile instead of `bench-release` (a fat-LTO
    /// build of 45+ minutes on 2 cores); give it before the benchmark's
    /// own flags.
    #[arg(long)]
    dev: bool,
    /// The benchmark to run, e.g. `ipam`.
    #[arg(required_unless_present = "list")]
    name: Option<String>,
    /// Further arguments for the benchmark binary.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        requires = "name",
        value_name = "BENCH_ARGS"
    )]
    args: Vec<String>,
}

/// Builds every binary in the bench profile (benchmarks drive the real
/// daemons, found next to `rivet-bench`), then runs the chosen benchmark.
pub fn run(args: &Args) -> Result<()> {
    let profile = if args.dev { "dev" } else { profile(args.name.as_deref()) };
    cmd::run(cmd::cargo().args(["build", "--profile", profile, "--workspace", "--bins"]))?;
    // The binary of that workspace build: `cargo run -p rivet-bench` would
    // resolve features for one package and rebuild much of it (fat LTO).
    let dir = if profile == "dev" { "debug" } else { profile };
    let bench = cmd::target_dir().join(dir).join("rivet-bench");
    cmd::run(std::process::Command::new(bench).args(bench_args(args)))
}

/// The cargo profile a benchmark's binaries are built in.
fn profile(name: Option<&str>) -> &'static str {
    match name {
        // Times the image's binaries in a cluster, not the local ones.
        Some("cluster") => "dev",
        _ => "bench-release",
    }
}

/// The arguments handed to the `rivet-bench` binary.
fn bench_args(args: &Args) -> Vec<String> {
    if args.list {
        return vec!["--list".to_string()];
    }
    args.name.iter().chain(&args.args).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(argv: &[&str]) -> Result<Vec<String>, clap::Error> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))?;
        Ok(bench_args(&cli.args))
    }

    #[test]
    fn name_and_extra_args_pass_through() {
        assert_eq!(parse(&["ipam"]).unwrap(), ["ipam"]);
        assert_eq!(
            parse(&["ipam", "--clients", "16", "--list"]).unwrap(),
            ["ipam", "--clients", "16", "--list"]
        );
    }

    #[test]
    fn only_the_cluster_bench_runs_the_dev_build() {
        assert_eq!(profile(Some("cluster")), "dev");
        assert_eq!(profile(Some("services")), "bench-release");
        assert_eq!(profile(None), "bench-release");
    }

    #[test]
    fn dev_before_the_benchmark_s_own_flags_is_ours() {
        for argv in [
            ["bench", "--dev", "scale", "--endpoints", "10"],
            ["bench", "scale", "--dev", "--endpoints", "10"],
        ] {
            let cli = Cli::try_parse_from(argv).unwrap();
            assert!(cli.args.dev, "{argv:?}");
            assert_eq!(bench_args(&cli.args), ["scale", "--endpoints", "10"]);
        }
        let cli = Cli::try_parse_from(["bench", "scale", "--endpoints", "10", "--dev"]).unwrap();
        assert!(!cli.args.dev);
        assert_eq!(bench_args(&cli.args), ["scale", "--endpoints", "10", "--dev"]);
        assert_eq!(profile(Some("scale")), "bench-release");
    }

    #[test]
    fn list_passes_through_and_name_is_otherwise_required() {
        assert_eq!(parse(&["--list"]).unwrap(), ["--list"]);
        assert!(parse(&[]).is_err());
    }
}
