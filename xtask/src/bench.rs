//! `cargo xtask bench <name>`: run one benchmark of the `bench/` crate.
//!
//! The benchmarks live in the `rivet-bench` binary, which takes the benchmark name and
//! prints its `RESULT ...` line itself; this only builds it with the `bench-release`
//! profile (optimised, with line tables for profiling) in one workspace build and runs
//! that binary with the arguments.

use anyhow::Result;

use crate::cmd;

/// Arguments of `cargo xtask bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// List the benchmarks instead of running one.
    #[arg(long, conflicts_with = "name")]
    list: bool,
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
    cmd::run(cmd::cargo().args(["build", "--profile", "bench-release", "--workspace", "--bins"]))?;
    // The binary of that workspace build: `cargo run -p rivet-bench` would
    // resolve features for one package and rebuild much of it (fat LTO).
    let bench = cmd::target_dir().join("bench-release").join("rivet-bench");
    cmd::run(std::process::Command::new(bench).args(bench_args(args)))
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
    fn list_passes_through_and_name_is_otherwise_required() {
        assert_eq!(parse(&["--list"]).unwrap(), ["--list"]);
        assert!(parse(&[]).is_err());
    }
}
