//! Developer and CI entry points for the Rivet workspace, run as `cargo xtask <command>`
//! (the alias lives in `.cargo/config.toml`).
//!
//! This is the `xtask` idiom aya uses: the project's build, test, demo and benchmark
//! procedures are plain Rust in the workspace instead of shell scripts, so they run the
//! same on a developer's machine and in CI, and every command first installs what it
//! needs so a fresh Debian 12 machine with only the Rust toolchain is enough.

mod bench;
mod chaos;
mod cluster;
mod cmd;
mod demo;
mod demo_cluster;
mod deps;
mod fuzz;
mod image;
mod install;
mod suite;
mod test;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Rivet's developer tasks. Run as root on Debian 12: every command first installs the
/// Debian packages and the bpffs mount that the privileged tests, the demo and the
/// benchmarks need.
#[derive(Debug, Parser)]
#[command(name = "xtask", bin_name = "cargo xtask", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install the Debian packages, mount bpffs, create the daemons' users and build
    /// the Go test tools (Kubernetes, etcd 3.6, Jaeger) into ~/.cache/rivet/tools
    /// (idempotent; needs root).
    Install,
    /// Run the whole suite: fmt check, the dependency rules, clippy -D warnings, all
    /// tests, doc tests.
    ///
    /// Without arguments the test binaries run several at a time
    /// (`RIVET_TEST_JOBS`, default cores + 1), longest first. Arguments after
    /// `--` are appended to both `cargo test` invocations instead, which then
    /// run one binary at a time, e.g. `cargo xtask test -- ipam -- --nocapture`.
    Test {
        /// Extra arguments for `cargo test` (after `--`).
        #[arg(last = true, value_name = "CARGO_TEST_ARGS")]
        cargo_test_args: Vec<String>,
    },
    /// Build the binaries and run the demo: one node (`rivet node up`), three pods
    /// through rivet-cni, a NetworkPolicy allowing and denying traffic, a daemon
    /// killed and restarted with no packet lost, and a clean teardown. With
    /// `--cluster`: three nodes (`rivet cluster up`), pods on each, traffic and a
    /// policy across nodes, `rivet node list` and `rivet health`, a node leaving.
    Demo {
        /// The multi-node demo instead.
        #[arg(long)]
        cluster: bool,
        /// Routing of the cluster demo: `native` or `vxlan`.
        #[arg(long, default_value = "vxlan", requires = "cluster",
              value_parser = clap::builder::PossibleValuesParser::new(["native", "vxlan"]))]
        routing: String,
    },
    /// A real Kubernetes cluster on this machine: `up` (control plane + kubelet workers
    /// in network namespaces, prints the kubeconfig), `down` (removes everything),
    /// `status`.
    Cluster(cluster::ClusterArgs),
    /// Build the OCI images (rivet: every binary; pause; busybox) as archives in
    /// target/images, tagged with the git revision, for `ctr -n k8s.io images import`.
    Image(image::Args),
    /// Run one benchmark of the `rivet-bench` crate with the bench-release profile.
    Bench(bench::Args),
    /// Build the cargo-fuzz targets of `fuzz/` (nightly) and run each for
    /// `--seconds` (default 30) from its checked-in seeds, printing
    /// executions, exec/s, corpus size and findings per target; fails on any
    /// finding.
    Fuzz(fuzz::Args),
    /// A chaos run (issue 19 §1): a `rivet cluster up` churned for `--minutes` with
    /// pod adds and deletes, policies applied and removed, kill -9 of node daemons and
    /// etcd restarts, checking that no address is held twice, that probed pods reach
    /// each other exactly as policy says, that long-lived flows lose nothing and that
    /// nothing is left at the end. Prints every violation with its seed and step and a
    /// summary; fails on any violation.
    Chaos(chaos::Args),
    /// Check that no daemon, the CLI or the CNI plugin links a crate it must not
    /// (rivet-testkit; aya and svc-loader in the unprivileged ones; svc-loader in svc-gc), as a workspace
    /// build resolves it.
    Deps,
    /// Write deploy/crds/ from rivet-k8s's CRD types (rivet-k8s's tests/crds.rs fails
    /// when the checked-in files differ from them).
    Crds,
}

/// Runs the command; errors are printed as a short cause chain (no backtrace, even with
/// `RUST_BACKTRACE` set: the messages name the failing command, which is what matters).
fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Install => install::run(),
        Command::Test { cargo_test_args } => {
            install::run()?;
            test::run(&cargo_test_args)
        }
        Command::Demo { cluster, routing } => {
            install::run()?;
            if cluster {
                demo_cluster::run(&routing)
            } else {
                demo::run()
            }
        }
        Command::Bench(args) => {
            install::run()?;
            bench::run(&args)
        }
        Command::Cluster(args) => {
            install::run()?;
            cluster::run(&args)
        }
        Command::Image(args) => {
            install::run()?;
            image::run(&args)
        }
        Command::Fuzz(args) => fuzz::run(&args),
        Command::Chaos(args) => {
            install::run()?;
            chaos::run(&args)
        }
        Command::Deps => deps::run(),
        Command::Crds => {
            let dir = cmd::workspace_root().join("deploy/crds");
            let mut write = cmd::cargo();
            write
                .args(["run", "--quiet", "-p", "rivet-k8s", "--example", "write_crds", "--"])
                .arg(dir);
            cmd::run(&mut write)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn test_passes_everything_after_double_dash() {
        let cli = Cli::try_parse_from(["xtask", "test", "--", "ipam", "--", "--nocapture"]).expect("parses");
        let Command::Test { cargo_test_args } = cli.command else {
            panic!("expected test, got {:?}", cli.command);
        };
        assert_eq!(cargo_test_args, ["ipam", "--", "--nocapture"]);
    }

    #[test]
    fn fuzz_takes_seconds_and_one_target() {
        let cli = Cli::try_parse_from(["xtask", "fuzz", "--seconds", "5", "cni_netconf"]).expect("parses");
        let Command::Fuzz(args) = cli.command else {
            panic!("expected fuzz, got {:?}", cli.command);
        };
        assert_eq!((args.seconds, args.target.as_deref()), (5, Some("cni_netconf")));
        assert!(Cli::try_parse_from(["xtask", "fuzz", "no_such_target"]).is_err());
        let Command::Fuzz(args) = Cli::try_parse_from(["xtask", "fuzz"]).expect("parses").command else {
            panic!("expected fuzz");
        };
        assert_eq!((args.seconds, args.target), (fuzz::DEFAULT_SECONDS, None));
    }
}
