//! `cargo xtask cluster up|down|status`: a real Kubernetes cluster on this machine
//! (control plane and kubelet workers in network namespaces; `rivet_e2e::kube_cluster`).
//!
//! The fixture lives in rivet-e2e, which tests share; its `rivet-kube-cluster` binary
//! keeps the cluster running in a background supervisor. This builds that binary (a
//! debug build, like the tests use) and hands it the command.

use std::process::Command;

use anyhow::Result;
use clap::{Args, Subcommand};

use crate::cmd;

/// `cargo xtask cluster ...`.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Where the cluster's files are (default `/tmp/rivet-kube-cluster`): one
    /// per cluster, so two users or two clusters do not meet.
    #[arg(long, global = true, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: ClusterCommand,
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Start etcd, kube-apiserver, kube-controller-manager and kube-scheduler in a
    /// control-plane namespace and the workers (containerd + kubelet each, in their own
    /// network and mount namespaces); prints the admin kubeconfig and the start time.
    Up {
        /// Number of workers.
        #[arg(long, default_value_t = 2)]
        workers: u16,
        /// The workers' pod network until Rivet is installed: `bridge` (reference
        /// bridge + host-local, nodes Ready) or `none` (for `kubectl apply -k deploy/`).
        #[arg(long, default_value = "bridge",
              value_parser = clap::builder::PossibleValuesParser::new(["bridge", "none"]))]
        cni: String,
        /// An OCI archive to import into every worker (repeatable), e.g. the Rivet
        /// image `cargo xtask image` wrote.
        #[arg(long = "image", value_name = "ARCHIVE")]
        images: Vec<std::path::PathBuf>,
    },
    /// Stop the cluster and remove everything it made.
    Down,
    /// Whether a cluster runs, and its kubeconfig.
    Status,
}

/// Builds `rivet-kube-cluster` and runs it with the command.
pub fn run(args: &ClusterArgs) -> Result<()> {
    cmd::run(cmd::cargo().args(["build", "-p", "rivet-e2e", "--bin", "rivet-kube-cluster"]))?;
    let binary = cmd::target_dir().join("debug").join("rivet-kube-cluster");
    let mut command = Command::new(binary);
    if let Some(dir) = &args.state_dir {
        // The binary runs from the workspace root: an absolute path.
        command.arg("--state-dir").arg(std::path::absolute(dir)?);
    }
    cmd::run(command.args(binary_args(&args.command)))
}

/// The arguments of `rivet-kube-cluster`.
fn binary_args(command: &ClusterCommand) -> Vec<String> {
    match command {
        ClusterCommand::Up { workers, cni, images } => {
            let mut args = vec![
                "up".into(),
                "--workers".into(),
                workers.to_string(),
                "--cni".into(),
                cni.clone(),
            ];
            for image in images {
                // The binary runs from the workspace root: absolute paths.
                let image = std::path::absolute(image).unwrap_or_else(|_| image.clone());
                args.push("--image".into());
                args.push(image.display().to_string());
            }
            args
        }
        ClusterCommand::Down => vec!["down".into()],
        ClusterCommand::Status => vec!["status".into()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_passes_workers_and_cni() {
        let args = binary_args(&ClusterCommand::Up {
            workers: 3,
            cni: "none".into(),
            images: vec!["/tmp/rivet.tar".into()],
        });
        assert_eq!(
            args,
            ["up", "--workers", "3", "--cni", "none", "--image", "/tmp/rivet.tar"]
        );
        assert_eq!(binary_args(&ClusterCommand::Down), ["down"]);
    }

    #[test]
    fn the_state_dir_is_taken_before_or_after_the_subcommand() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            cluster: ClusterArgs,
        }
        for argv in [
            ["x", "--state-dir", "/tmp/c2", "down"],
            ["x", "down", "--state-dir", "/tmp/c2"],
        ] {
            let cli = Cli::try_parse_from(argv).expect("--state-dir is global");
            assert_eq!(cli.cluster.state_dir.as_deref(), Some(std::path::Path::new("/tmp/c2")));
        }
    }
}
