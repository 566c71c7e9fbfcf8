//! End-to-end support: containerd 1.6 with runc, started by the test with
//! its own root, state and sockets, driven through the Kubernetes CRI API the
//! way kubelet drives it, so that pods are created and destroyed by the real
//! runtime calling the CNI plugin (rivet-cni, or the reference plugins).
//!
//! - [`containerd`]: the [`Containerd`](containerd::Containerd) guard (config,
//!   start inside a node network namespace, teardown that leaves nothing);
//! - [`image`]: the pause and busybox images (`rivet-oci`, from the host's
//!   static busybox), imported with `ctr`;
//! - [`cri`]: a small CRI client (pod sandboxes, containers, `ExecSync`);
//! - [`cross_node`]: pod to pod across the cluster's nodes (ping and a TCP
//!   echo through `kubectl exec`);
//! - [`kube_cluster`]: a real Kubernetes cluster (control plane + kubelet
//!   workers, each with its own containerd) in network namespaces;
//! - [`kube_deploy`]: Rivet installed on that cluster with `kubectl apply -k
//!   deploy/` (its image under two tags, an overlay for a rolling update),
//!   and traffic from pods counted while Rivet is disrupted;
//! - [`node`]: a Rivet node made by `rivet node up` whose CNI directories
//!   containerd reads;
//! - [`node_clean`]: what Rivet left on a worker of [`kube_cluster`] (the
//!   uninstall check);
//! - [`runtime::v1`]: the generated CRI API (`runtime.v1`, client side).
//!
//! The test flow (`tests/containerd.rs`, README "Running pods with
//! containerd"): write a CNI conflist and the plugin binaries into
//! directories the test owns → start containerd inside the node namespace →
//! import the images → `RunPodSandbox` (CNI ADD) → `CreateContainer` /
//! `StartContainer` → `ExecSync` ping / nc → `StopPodSandbox` (CNI DEL) →
//! `RemovePodSandbox`.

pub mod containerd;
pub mod cri;
pub mod cross_node;
pub mod image;
pub mod kube_cluster;
pub mod kube_deploy;
pub mod node;
pub mod node_clean;

use std::path::PathBuf;
use std::process::ExitStatus;

/// The Kubernetes CRI API (`k8s.io/cri-api`, package `runtime.v1`).
pub mod runtime {
    /// Version 1, as served by containerd 1.6's CRI plugin.
    // Generated from the upstream proto, whose comments write placeholders
    // as `<name>`, which rustdoc would read as HTML.
    #[allow(missing_docs, clippy::all, rustdoc::invalid_html_tags)]
    pub mod v1 {
        tonic::include_proto!("runtime.v1");
    }
}

/// What this machine lacks for the harness.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Missing {
    /// Not running as root.
    #[error("running pods with containerd needs root (mounts, namespaces, cgroups)")]
    Root,
    /// A required binary is not on `PATH`.
    #[error("`{binary}` is not on PATH ({package}); containerd with runc is needed to run pods (PATH={path})")]
    Binary {
        /// The binary.
        binary: String,
        /// The Debian package that provides it.
        package: String,
        /// The `PATH` searched.
        path: String,
    },
}

/// Everything that can go wrong while running pods.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Something this machine must provide is missing (a binary, root).
    #[error("the containerd e2e harness cannot run: {0}")]
    Missing(#[from] Missing),
    /// Building or writing the test images failed (a missing static busybox
    /// included).
    #[error("the e2e images: {0}")]
    Image(#[from] rivet_oci::Error),
    /// A command ran and failed.
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: ExitStatus,
        /// Its stderr (and stdout), trimmed.
        stderr: String,
    },
    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
    /// containerd did not start or died; the end of its log.
    #[error("containerd ({config}): {reason}; log:\n{log}")]
    Containerd {
        /// Its config file.
        config: PathBuf,
        /// What happened.
        reason: String,
        /// The last lines of its log.
        log: String,
    },
    /// A CRI call failed.
    #[error("CRI {call}: {status}")]
    Cri {
        /// The call (and its subject).
        call: String,
        /// The gRPC status.
        status: Box<tonic::Status>,
    },
    /// Connecting to the CRI socket failed.
    #[error("connecting to the CRI socket: {0}")]
    Connect(#[from] rivet_common::grpc::ConnectError),
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_context(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

pub(crate) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
