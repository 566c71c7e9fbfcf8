//! `cargo xtask chaos [--minutes N] [--seed S] [--nodes 2|3]`: the chaos run
//! of `rivet_testkit::chaos` (issue 19 §1) on a `rivet cluster up` of this
//! machine. Builds every binary (debug, as the tests use them) and runs
//! `rivet-chaos`, which prints each violation with its seed and step and a
//! summary, and fails when there was a violation.

use std::process::Command;

use anyhow::Result;

use crate::cmd;

/// Arguments of `cargo xtask chaos`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Minutes of churn.
    #[arg(long, default_value_t = 10)]
    pub minutes: u64,
    /// Seed of every choice; default: from the clock (printed first).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Nodes: 2 or 3.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(2..=3))]
    pub nodes: u64,
    /// Churned pods live at most at once.
    #[arg(long, default_value_t = 200)]
    pub max_pods: usize,
    /// `native` or `vxlan` routing.
    #[arg(long, default_value = "native",
          value_parser = clap::builder::PossibleValuesParser::new(["native", "vxlan"]))]
    pub routing: String,
}

/// Builds the binaries and runs `rivet-chaos` with the arguments.
pub fn run(args: &Args) -> Result<()> {
    cmd::run(cmd::cargo().args(["build", "--workspace", "--bins"]))?;
    let binary = cmd::target_dir().join("debug").join("rivet-chaos");
    cmd::run(Command::new(binary).args(binary_args(args)))
}

/// The arguments of `rivet-chaos`.
fn binary_args(args: &Args) -> Vec<String> {
    let mut out = vec![
        "--minutes".to_string(),
        args.minutes.to_string(),
        "--nodes".into(),
        args.nodes.to_string(),
        "--max-pods".into(),
        args.max_pods.to_string(),
        "--routing".into(),
        args.routing.clone(),
    ];
    if let Some(seed) = args.seed {
        out.extend(["--seed".into(), seed.to_string()]);
    }
    out
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

    #[test]
    fn minutes_seed_and_nodes_pass_through() {
        let cli = Cli::try_parse_from(["chaos", "--minutes", "30", "--seed", "7", "--nodes", "2"]).expect("parses");
        assert_eq!(
            binary_args(&cli.args),
            [
                "--minutes",
                "30",
                "--nodes",
                "2",
                "--max-pods",
                "200",
                "--routing",
                "native",
                "--seed",
                "7"
            ]
        );
        assert!(Cli::try_parse_from(["chaos", "--nodes", "4"]).is_err());
        let defaults = Cli::try_parse_from(["chaos"]).expect("parses");
        assert_eq!((defaults.args.minutes, defaults.args.seed), (10, None));
    }
}
