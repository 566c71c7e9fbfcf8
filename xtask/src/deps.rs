//! `cargo xtask deps`: which crates the daemons, the CLI and the CNI plugin must not
//! link, checked on the graph a workspace build resolves.
//!
//! A crate's features are unified across everything built together, so a benchmark
//! that asks for a daemon library's test feature changes that daemon's own binary
//! (svc-endpoint's old `testing` feature linked svc-loader and aya into svc-endpoint
//! under `cargo build --bins`). `cargo tree --workspace -e normal,build` resolves the
//! graph as such a build does (dev-dependencies and their features left out), so its
//! inverted tree of a crate names every workspace package that links it.

use std::collections::BTreeSet;

use anyhow::{Context, Result, bail};

use crate::cmd;

/// The unprivileged daemons, the CLI, the CNI plugin and the libraries they share.
const UNPRIVILEGED: &[&str] = &[
    "rivet-proto",
    "rivet-common",
    "rivet-policy",
    "svc-ipam",
    "svc-identity",
    "svc-endpoint",
    "svc-health",
    "svc-k8s-sync",
    "rivet-operator",
    "rivet-cni",
    "rivet-cli",
];

/// Who may link a crate.
#[derive(Debug, Clone, Copy)]
pub enum Linkers {
    /// Only these packages (and the crate itself).
    Only(&'static [&'static str]),
    /// Any package but these.
    Not(&'static [&'static str]),
}

impl Linkers {
    fn allows(self, package: &str) -> bool {
        match self {
            Linkers::Only(allowed) => allowed.contains(&package),
            Linkers::Not(denied) => !denied.contains(&package),
        }
    }
}

/// A crate that only some workspace packages may link.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    /// The crate's package name.
    pub krate: &'static str,
    /// Who may link it, directly or through other crates.
    pub linkers: Linkers,
    /// Why, for the error message.
    pub why: &'static str,
}

/// The workspace's rules.
pub const RULES: &[Rule] = &[
    Rule {
        krate: "rivet-testkit",
        linkers: Linkers::Only(&["rivet-bench"]),
        why: "test harnesses are for tests (dev-dependencies) and benchmarks",
    },
    Rule {
        krate: "rivet-e2e",
        linkers: Linkers::Only(&["rivet-bench"]),
        why: "the end-to-end fixtures (the kubelet cluster) are for tests and benchmarks",
    },
    Rule {
        krate: "svc-loader",
        linkers: Linkers::Not(UNPRIVILEGED),
        why: "the privileged daemon's code stays out of the unprivileged binaries",
    },
    Rule {
        krate: "svc-loader",
        linkers: Linkers::Not(&["svc-gc", "rivet-datapath"]),
        why: "svc-gc reads the pinned maps through the datapath ABI crate, not the loader",
    },
    Rule {
        krate: "aya",
        linkers: Linkers::Not(UNPRIVILEGED),
        why: "BPF objects are the privileged daemons' business",
    },
];

/// Checks [`RULES`] on the workspace.
pub fn run() -> Result<()> {
    let broken = violations(RULES, linkers)?;
    if !broken.is_empty() {
        bail!("crates linked where they must not be:\n{}", broken.join("\n"));
    }
    println!("no daemon, CLI or CNI binary links a crate it must not");
    Ok(())
}

/// Each package that links a rule's crate against the rule, as one line naming the
/// package, the crate, why not, and the command that shows the path.
pub fn violations(rules: &[Rule], linkers: impl Fn(&str) -> Result<BTreeSet<String>>) -> Result<Vec<String>> {
    let mut broken = Vec::new();
    for rule in rules {
        for package in linkers(rule.krate)? {
            if package != rule.krate && !rule.linkers.allows(&package) {
                broken.push(format!(
                    "{package} links {} ({}); the path: cargo tree --workspace -e normal,build -i {}",
                    rule.krate, rule.why, rule.krate
                ));
            }
        }
    }
    Ok(broken)
}

/// The packages that link `krate` (itself included) in a workspace build: normal and
/// build dependencies, features unified across the workspace. Empty if nothing does.
pub fn linkers(krate: &str) -> Result<BTreeSet<String>> {
    let mut tree = cmd::cargo();
    tree.args([
        "tree",
        "--workspace",
        "-e",
        "normal,build",
        "--prefix",
        "none",
        "--format",
        "{p}",
    ])
    .args(["-i", krate]);
    if cmd::workspace_root().join("Cargo.lock").exists() {
        tree.arg("--locked");
    }
    let output = tree
        .output()
        .with_context(|| format!("running `{}`", cmd::display(&tree)))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        // `-i` of a crate no package depends on is an error, not an empty tree.
        if stderr.contains("did not match any packages") {
            return Ok(BTreeSet::new());
        }
        bail!(
            "`{}` failed ({}): {}",
            cmd::display(&tree),
            output.status,
            stderr.trim()
        );
    }
    Ok(packages(&String::from_utf8_lossy(&output.stdout)))
}

/// Package names of `cargo tree --prefix none --format {p}` lines (`name vX.Y.Z (path) (*)`).
fn packages(tree: &str) -> BTreeSet<String> {
    tree.lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_lines_give_package_names() {
        let tree = "svc-loader v0.1.0 (/w/svc-loader)\nrivet-bench v0.1.0 (/w/bench)\n\
                    svc-loader v0.1.0 (/w/svc-loader) (*)\n\n";
        assert_eq!(
            packages(tree),
            BTreeSet::from(["rivet-bench".into(), "svc-loader".into()])
        );
    }

    #[test]
    fn a_daemon_linking_a_forbidden_crate_is_named() {
        // What `cargo build --bins` resolved before rivet-testkit and rivet-datapath:
        // rivet-bench enabled svc-endpoint's `testing` feature, which linked svc-loader
        // into svc-endpoint; svc-gc linked svc-loader for its map definitions.
        let linkers = |krate: &str| -> Result<BTreeSet<String>> {
            Ok(match krate {
                "svc-loader" => ["svc-loader", "svc-endpoint", "svc-gc", "rivet-bench"],
                "aya" => ["aya", "svc-loader", "svc-endpoint", "rivet-bench"],
                "rivet-e2e" => ["rivet-e2e", "rivet-bench", "rivet-bench", "rivet-bench"],
                _ => ["rivet-testkit", "rivet-bench", "svc-gc", "rivet-bench"],
            }
            .into_iter()
            .map(str::to_owned)
            .collect())
        };
        let broken = violations(RULES, linkers).unwrap();
        assert_eq!(broken.len(), 4, "{broken:#?}");
        assert!(broken[0].starts_with("svc-gc links rivet-testkit ("), "{broken:#?}");
        assert!(broken[1].starts_with("svc-endpoint links svc-loader ("), "{broken:#?}");
        assert!(broken[2].starts_with("svc-gc links svc-loader ("), "{broken:#?}");
        assert!(broken[3].starts_with("svc-endpoint links aya ("), "{broken:#?}");
        assert!(
            broken[3].ends_with("cargo tree --workspace -e normal,build -i aya"),
            "{broken:#?}"
        );
    }

    #[test]
    fn the_workspace_follows_the_rules() {
        let broken = violations(RULES, linkers).unwrap();
        assert!(broken.is_empty(), "{}", broken.join("\n"));
        // The check sees real edges, not only the crate itself.
        assert!(linkers("aya").unwrap().contains("svc-loader"));
    }
}
