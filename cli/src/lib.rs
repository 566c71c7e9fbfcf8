//! `rivet`, the command line of a Rivet node: daemon status and inspection
//! and debugging commands per daemon. Every command prints a table by default
//! and JSON with `-o json`.

pub mod bpf;
pub mod identity;
pub mod ipam;
pub mod status;
pub mod table;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ValueEnum;
use rivet_common::grpc::{self, ClientOptions, DaemonChannel};
use serde::Serialize;

/// Every node daemon, in start order; `rivet status` probes each.
pub const DAEMONS: [&str; 6] = [
    "svc-ipam",
    "svc-identity",
    "svc-loader",
    "svc-endpoint",
    "svc-gc",
    "svc-k8s-sync",
];

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    Table,
    /// JSON for scripts.
    Json,
}

/// What every command needs: where the sockets are and how to print.
#[derive(Debug, Clone)]
pub struct Context {
    /// Directory of the daemon sockets.
    pub socket_dir: PathBuf,
    /// Output format.
    pub output: Output,
    /// Deadline for connecting and for each call.
    pub timeout: Duration,
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The daemon could not be reached.
    #[error("{daemon}: {source}")]
    Connect {
        /// Which daemon.
        daemon: &'static str,
        /// Why.
        source: grpc::ConnectError,
    },
    /// The daemon refused the call.
    #[error("{daemon}: {code:?}: {message}")]
    Rpc {
        /// Which daemon.
        daemon: &'static str,
        /// gRPC code.
        code: tonic::Code,
        /// The daemon's message.
        message: String,
    },
    /// Bad input on the command line.
    #[error("{0}")]
    Usage(String),
}

impl CliError {
    /// Wraps a gRPC status from `daemon`.
    pub fn rpc(daemon: &'static str, status: tonic::Status) -> Self {
        Self::Rpc {
            daemon,
            code: status.code(),
            message: status.message().to_string(),
        }
    }
}

impl Context {
    /// The socket of `daemon`.
    pub fn socket(&self, daemon: &str) -> PathBuf {
        rivet_common::socket::socket_path(&self.socket_dir, daemon)
    }

    /// A channel to `daemon`, failing after the timeout.
    pub async fn connect(&self, daemon: &'static str) -> Result<DaemonChannel, CliError> {
        connect(&self.socket(daemon), self.timeout)
            .await
            .map_err(|source| CliError::Connect { daemon, source })
    }

    /// Prints `value` as JSON, or `table()` as text.
    pub fn print<T: Serialize>(&self, value: &T, table: impl FnOnce() -> String) {
        match self.output {
            Output::Json => println!(
                "{}",
                serde_json::to_string_pretty(value).expect("CLI output is always serialisable")
            ),
            Output::Table => print!("{}", table()),
        }
    }
}

async fn connect(path: &Path, timeout: Duration) -> Result<DaemonChannel, grpc::ConnectError> {
    grpc::connect_unix(
        path,
        &ClientOptions {
            connect_timeout: timeout,
            request_timeout: timeout,
            ..ClientOptions::default()
        },
    )
    .await
}
