//! `cargo xtask fuzz [--seconds N] [TARGET]`: builds the cargo-fuzz targets of
//! `fuzz/` (nightly, optimised, debug assertions and overflow checks on,
//! AddressSanitizer) and runs each for N seconds from its checked-in seeds,
//! then prints per target the executions, exec/s, corpus size and findings.
//! Any finding (a crash, leak, timeout or out-of-memory input, kept under
//! `fuzz/artifacts/<target>/`) fails the task.
//!
//! New inputs go to a scratch corpus in `fuzz/target/corpus/<target>/`
//! (libFuzzer writes into the first corpus directory it is given), so the
//! checked-in `fuzz/corpus/<target>/` stays the small seed set it is.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::cmd;

/// The targets, in the order they run (the `[[bin]]`s of fuzz/Cargo.toml).
pub const TARGETS: [&str; 5] = [
    "cni_netconf",
    "labels_selectors",
    "policy_document",
    "grpc_requests",
    "packet_path",
];

/// Seconds per target of `cargo xtask fuzz` without `--seconds`.
pub const DEFAULT_SECONDS: u64 = 30;

/// Arguments of `cargo xtask fuzz`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// How long each target runs.
    #[arg(long, default_value_t = DEFAULT_SECONDS)]
    pub seconds: u64,
    /// Leave svc-identity and svc-endpoint out of `grpc_requests` (they pull
    /// kube, k8s-openapi and etcd-client: most of a cold build).
    #[arg(long)]
    pub no_k8s_daemons: bool,
    /// An unoptimised build without AddressSanitizer: about 40% of the CPU
    /// of a cold optimised build, with slower runs (the suite's smoke run).
    #[arg(long)]
    pub dev: bool,
    /// Run only this target.
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(TARGETS))]
    pub target: Option<String>,
}

/// One target's run, from libFuzzer's final stats.
#[derive(Debug, Default, PartialEq)]
struct Stats {
    executions: u64,
    exec_per_second: u64,
    corpus: u64,
    new_units: u64,
}

/// Builds the targets and runs them; fails if any target found something.
pub fn run(args: &Args) -> Result<()> {
    crate::install::cargo_fuzz()?;
    cmd::run(&mut build(args.dev, args.no_k8s_daemons))?;
    let targets: Vec<&str> = match &args.target {
        Some(t) => vec![t.as_str()],
        None => TARGETS.to_vec(),
    };
    let mut report = Vec::new();
    for target in targets {
        report.push((target, run_target(target, args.seconds, args.dev)?));
    }
    println!(
        "\n{:<18} {:>12} {:>10} {:>8} {:>6} {:>9}",
        "target", "executions", "exec/s", "corpus", "new", "findings"
    );
    let mut failed = Vec::new();
    for (target, (stats, findings)) in &report {
        println!(
            "{target:<18} {:>12} {:>10} {:>8} {:>6} {:>9}",
            stats.executions,
            stats.exec_per_second,
            stats.corpus,
            stats.new_units,
            findings.len()
        );
        if !findings.is_empty() {
            failed.push(format!("{target}: {}", findings.join(", ")));
        }
    }
    // The plain closing line a CI log reader counts.
    println!("fuzz: {} passed, {} failed", report.len() - failed.len(), failed.len());
    if !failed.is_empty() {
        bail!(
            "the fuzzers found inputs that fail (reproduce with `cargo +nightly fuzz run <target> <file>`, then \
             add each as a regression test beside the code it broke):\n{}",
            failed.join("\n")
        );
    }
    Ok(())
}

/// `cargo +nightly fuzz build`: every target, optimised with debug
/// assertions (or, `dev`, unoptimised without a sanitizer), so a run below
/// starts at once.
pub fn build(dev: bool, no_k8s_daemons: bool) -> Command {
    let mut build = nightly_cargo();
    build.args(["fuzz", "build"]);
    if dev {
        build.args(["--dev", "--sanitizer", "none"]);
    } else {
        build.args(["-O", "--debug-assertions"]);
    }
    if no_k8s_daemons {
        build.arg("--no-default-features");
    }
    build
}

/// The rustup proxy with `+nightly`, without the variables the stable
/// cargo running xtask set (they would pin the nested build to stable).
fn nightly_cargo() -> Command {
    let mut cargo = Command::new("cargo");
    cargo
        .arg("+nightly")
        .current_dir(cmd::workspace_root())
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO");
    cargo
}

fn fuzz_dir() -> PathBuf {
    cmd::workspace_root().join("fuzz")
}

/// Runs the built `target` binary for `seconds` from its seeds; returns its
/// stats and the findings it wrote.
fn run_target(target: &str, seconds: u64, dev: bool) -> Result<(Stats, Vec<String>)> {
    let dir = fuzz_dir();
    let profile = if dev { "debug" } else { "release" };
    let binary = dir.join("target/x86_64-unknown-linux-gnu").join(profile).join(target);
    let scratch = dir.join("target/corpus").join(target);
    let seeds = dir.join("corpus").join(target);
    let artifacts = dir.join("artifacts").join(target);
    for d in [&scratch, &artifacts] {
        fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let before = files(&artifacts)?;
    let mut fuzz = Command::new(&binary);
    fuzz.arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        .arg("-timeout=10")
        .arg("-rss_limit_mb=2048")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg(&scratch)
        .arg(&seeds)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    println!("==> fuzz {target} for {seconds} s\n$ {}", cmd::display(&fuzz));
    let output = fuzz
        .output()
        .with_context(|| format!("running {} (was it built?)", binary.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stats = parse_stats(&stderr);
    let mut findings: Vec<String> = files(&artifacts)?.into_iter().filter(|f| !before.contains(f)).collect();
    if !output.status.success() && findings.is_empty() {
        findings.push(format!("exit {} with no artifact", output.status));
    }
    if !findings.is_empty() {
        eprintln!("{}", cmd::tail_lines(&stderr, 60));
    }
    Ok((stats, findings))
}

/// Files in `dir` (paths, sorted).
fn files(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        out.push(entry?.path().display().to_string());
    }
    out.sort();
    Ok(out)
}

/// libFuzzer's `-print_final_stats=1` lines (`stat::number_of_executed_units: 1234`)
/// and the corpus size of its last status line (`#1234 DONE cov: 56 ft: 78 corp: 9/1Kb ...`).
fn parse_stats(stderr: &str) -> Stats {
    let stat = |name: &str| {
        stderr
            .lines()
            .find_map(|l| l.strip_prefix(&format!("stat::{name}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let corpus = stderr
        .lines()
        .rev()
        .find_map(|l| l.split_once(" corp: "))
        .and_then(|(_, rest)| rest.split('/').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    Stats {
        executions: stat("number_of_executed_units"),
        exec_per_second: stat("average_exec_per_sec"),
        corpus,
        new_units: stat("new_units_added"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_final_stats() {
        let stderr = "INFO: Seed: 1\n#2\tINITED cov: 10 ft: 11 corp: 3/120b exec/s: 0 rss: 40Mb\n\
                      #9000\tDONE   cov: 50 ft: 80 corp: 27/1234b lim: 4 exec/s: 300 rss: 60Mb\n\
                      Done 9000 runs in 30 second(s)\nstat::number_of_executed_units: 9000\n\
                      stat::average_exec_per_sec:     300\nstat::new_units_added:          24\n";
        assert_eq!(
            parse_stats(stderr),
            Stats {
                executions: 9000,
                exec_per_second: 300,
                corpus: 27,
                new_units: 24
            }
        );
        assert_eq!(parse_stats("garbage"), Stats::default());
    }

    #[test]
    fn every_target_has_seeds_and_a_source() {
        for target in TARGETS {
            let seeds = files(&fuzz_dir().join("corpus").join(target)).unwrap();
            assert!(!seeds.is_empty(), "{target} has no checked-in seeds");
            assert!(fuzz_dir().join("fuzz_targets").join(format!("{target}.rs")).exists());
        }
    }

    #[test]
    fn builds_with_nightly_and_debug_assertions() {
        let rendered = cmd::display(&build(false, true));
        assert!(
            rendered.ends_with("cargo +nightly fuzz build -O --debug-assertions --no-default-features"),
            "{rendered}"
        );
        assert!(!cmd::display(&build(false, false)).contains("no-default-features"));
        assert!(cmd::display(&build(true, true)).ends_with("fuzz build --dev --sanitizer none --no-default-features"));
    }
}
