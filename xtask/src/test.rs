//! `cargo xtask test`: the whole suite, as CI runs it (`.ci/run` calls only this).
//!
//! Steps run in order and stop at the first failure, cheapest first, so a formatting
//! slip fails in seconds instead of after a full test build. Output of every step goes
//! straight to the terminal: CI reads cargo test's own summary lines from stdout.

use std::process::Command;

use anyhow::{Context, Result};

use crate::cmd;

/// Runs fmt check, clippy, all tests and doc tests; `cargo_test_args` are appended to
/// both `cargo test` invocations (a filter, cargo flags, or `-- <test binary args>`).
pub fn run(cargo_test_args: &[String]) -> Result<()> {
    for (name, mut command) in steps(cargo_test_args) {
        println!("==> {name}");
        cmd::run(&mut command).with_context(|| format!("step `{name}` failed"))?;
    }
    println!("==> all steps passed");
    Ok(())
}

/// The steps, each with a short name for its header.
fn steps(cargo_test_args: &[String]) -> Vec<(&'static str, Command)> {
    let mut fmt = cmd::cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);

    let mut clippy = cmd::cargo();
    clippy.args(["clippy", "--workspace", "--all-targets"]);
    // `--locked` makes CI fail instead of silently resolving new versions, but needs a
    // lock file to compare against (the first commit of a workspace may lack one).
    if cmd::workspace_root().join("Cargo.lock").exists() {
        clippy.arg("--locked");
    }
    clippy.args(["--", "-D", "warnings"]);

    // `--all-targets` does not include doc tests, hence the separate `--doc` run.
    let mut tests = cmd::cargo();
    tests
        .args(["test", "--workspace", "--all-targets"])
        .args(cargo_test_args);

    let mut doc_tests = cmd::cargo();
    doc_tests.args(["test", "--workspace", "--doc"]).args(cargo_test_args);

    vec![
        ("fmt", fmt),
        ("clippy", clippy),
        ("test", tests),
        ("doc tests", doc_tests),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_args_go_to_both_test_runs_only() {
        let extra = ["ipam".to_string(), "--".to_string(), "--nocapture".to_string()];
        let rendered: Vec<(&str, String)> = steps(&extra)
            .iter()
            .map(|(name, command)| (*name, cmd::display(command)))
            .collect();
        let names: Vec<&str> = rendered.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["fmt", "clippy", "test", "doc tests"]);
        assert!(rendered[0].1.ends_with("fmt --all -- --check"));
        assert!(rendered[1].1.ends_with("-- -D warnings"));
        assert!(
            rendered[2]
                .1
                .ends_with("test --workspace --all-targets ipam -- --nocapture")
        );
        assert!(rendered[3].1.ends_with("test --workspace --doc ipam -- --nocapture"));
    }
}
