//! `rivet`, the command line of a Rivet node: daemon status and inspection
//! and debugging commands per daemon, `rivet node up|down` (the single-node
//! launcher and supervisor), `rivet cluster up|down` (a multi-node cluster
//! of node namespaces on one machine) and `rivet pod` (test pods through the
//! real CNI plugin). Every command prints a table by default and JSON with `-o json`.

pub mod accounts;
pub mod bpf;
pub mod cluster;
pub mod endpoint;
pub mod gc;
pub mod health;
pub mod identity;
pub mod ipam;
pub mod namespace;
pub mod netns;
pub mod node;
pub mod pod;
pub mod policy;
pub mod service;
pub mod status;
pub mod table;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::ValueEnum;
use rivet_common::grpc::{self, ClientOptions, DaemonChannel};
use serde::Serialize;

/// Every node daemon, in start order; `rivet status` probes each.
pub const DAEMONS: [&str; 7] = [
    "svc-ipam",
    "svc-identity",
    "svc-loader",
    "svc-endpoint",
    "svc-gc",
    "svc-health",
    "svc-k8s-sync",
];

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    Table,
    /// JSON for scripts.
    Json,
    /// YAML (the JSON form as YAML).
    Yaml,
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
    /// Labels on the command line are refused.
    #[error(transparent)]
    Labels(#[from] namespace::LabelArgError),
    /// `rivet ipam release` without what to release.
    #[error("give --container-id or --address")]
    NoReleaseTarget,
    /// A policy input could not be read.
    #[error("reading {input}: {source}")]
    ReadInput {
        /// The file, or standard input.
        input: String,
        /// Why.
        source: std::io::Error,
    },
    /// A policy input is not a sequence of documents.
    #[error("{input}: {source}")]
    Documents {
        /// The file, or standard input.
        input: String,
        /// Why.
        source: rivet_policy::documents::DocumentsError,
    },
    /// A policy input holds no document.
    #[error("{input}: no policy document")]
    NoDocument {
        /// The file, or standard input.
        input: String,
    },
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

    /// A channel to `daemon` for calls made with [`Context::request`]: the
    /// daemon is told the deadline and the channel waits one second longer, so
    /// that the daemon's own DEADLINE_EXCEEDED answer (which says what stays
    /// done) arrives instead of a local timeout that says nothing.
    pub async fn connect_with_deadline(&self, daemon: &'static str) -> Result<DaemonChannel, CliError> {
        grpc::connect_unix(
            &self.socket(daemon),
            &ClientOptions {
                connect_timeout: self.timeout,
                request_timeout: self.timeout + DEADLINE_GRACE,
                ..ClientOptions::default()
            },
        )
        .await
        .map_err(|source| CliError::Connect { daemon, source })
    }

    /// `message` as a request carrying the timeout as its deadline
    /// (`grpc-timeout`), for a channel from [`Context::connect_with_deadline`].
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }

    /// Prints `value` as JSON, or `table()` as text.
    pub fn print<T: Serialize>(&self, value: &T, table: impl FnOnce() -> String) {
        match self.output {
            Output::Json => println!(
                "{}",
                serde_json::to_string_pretty(value).expect("CLI output is always serialisable")
            ),
            Output::Yaml => print!(
                "{}",
                serde_norway::to_string(value).expect("CLI output is always serialisable")
            ),
            Output::Table => print!("{}", table()),
        }
    }
}

/// The first line of an `apply` that stopped at document `number`: for an
/// invalid document the daemon's message (it names the field path and the
/// reason), otherwise the code too.
///
/// ```
/// let line = rivet_cli::document_failure(2, "line 14", true, "InvalidArgument", "spec.ports: required");
/// assert_eq!(line, "error: document 2 (line 14) is invalid: spec.ports: required\n");
/// ```
pub fn document_failure(number: usize, location: &str, invalid: bool, code: &str, message: &str) -> String {
    if invalid {
        format!("error: document {number} ({location}) is invalid: {message}\n")
    } else {
        format!("error: document {number} ({location}): {code}: {message}\n")
    }
}

/// How much longer than the deadline a [`Context::connect_with_deadline`]
/// channel waits for the answer.
const DEADLINE_GRACE: Duration = Duration::from_secs(1);

/// The current time as Unix nanoseconds, the unit of the API's `*_unix_nanos`.
pub fn now_unix_nanos() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// How long ago `at_unix_nanos` was at `now_unix_nanos`, coarse and short
/// (`850ms`, `42s`, `3m12s`, `5h20m`, `2d3h`); `-` for 0 (never). A time in
/// the future (clock skew) counts as now.
///
/// ```
/// let now = 1_000 * 1_000_000_000;
/// assert_eq!(rivet_cli::age(now, now - 192 * 1_000_000_000), "3m12s");
/// assert_eq!(rivet_cli::age(now, 0), "-");
/// ```
pub fn age(now_unix_nanos: i64, at_unix_nanos: i64) -> String {
    if at_unix_nanos <= 0 {
        return "-".into();
    }
    coarse(u64::try_from(now_unix_nanos.saturating_sub(at_unix_nanos)).unwrap_or(0))
}

/// `nanos` in at most two units, the smaller one truncated.
fn coarse(nanos: u64) -> String {
    let seconds = nanos / 1_000_000_000;
    match seconds {
        0 => format!("{}ms", nanos / 1_000_000),
        1..60 => format!("{seconds}s"),
        60..3_600 => format!("{}m{}s", seconds / 60, seconds % 60),
        3_600..86_400 => format!("{}h{}m", seconds / 3_600, seconds % 3_600 / 60),
        _ => format!("{}d{}h", seconds / 86_400, seconds % 86_400 / 3_600),
    }
}

/// How long something took, precise for short times (`640µs`, `35ms`,
/// `1.2s`, always truncated) and like [`age`] beyond a minute.
///
/// ```
/// assert_eq!(rivet_cli::duration(35_400_000), "35ms");
/// assert_eq!(rivet_cli::duration(1_250_000_000), "1.2s");
/// ```
pub fn duration(nanos: u64) -> String {
    match nanos {
        0..1_000_000 => format!("{}µs", nanos / 1_000),
        1_000_000..1_000_000_000 => format!("{}ms", nanos / 1_000_000),
        1_000_000_000..60_000_000_000 => format!("{}.{}s", nanos / 1_000_000_000, nanos / 100_000_000 % 10),
        _ => coarse(nanos),
    }
}

/// Aligned `NAME  value` lines, for one object shown in full. A value with
/// several lines continues under its first line; an empty value shows `-`.
///
/// ```
/// let text = rivet_cli::fields([("ID", "12".to_string()), ("LABELS", "k8s:a=b\nk8s:c=d".to_string())]);
/// assert_eq!(text, "ID      12\nLABELS  k8s:a=b\n        k8s:c=d\n");
/// ```
pub fn fields<'a>(rows: impl IntoIterator<Item = (&'a str, String)>) -> String {
    let rows: Vec<(&str, String)> = rows.into_iter().collect();
    let width = rows.iter().map(|(name, _)| name.chars().count()).max().unwrap_or(0);
    let mut out = String::new();
    for (name, value) in &rows {
        let value = if value.is_empty() { "-" } else { value.as_str() };
        for (i, line) in value.lines().enumerate() {
            let label = if i == 0 { *name } else { "" };
            out.push_str(format!("{label:<width$}  {line}").trim_end());
            out.push('\n');
        }
    }
    out
}

/// `text` cut to at most `max` characters, ending in `…` when cut.
///
/// ```
/// assert_eq!(rivet_cli::truncate("datapath: attach failed", 12), "datapath: a…");
/// assert_eq!(rivet_cli::truncate("short", 12), "short");
/// ```
pub fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    #[test]
    fn ages() {
        let now = 1_700_000_000 * S;
        assert_eq!(age(now, 0), "-");
        assert_eq!(age(now, now), "0ms");
        assert_eq!(age(now, now - 850_000_000), "850ms");
        assert_eq!(age(now, now - 42 * S), "42s");
        assert_eq!(age(now, now - 60 * S), "1m0s");
        assert_eq!(age(now, now - (5 * 3_600 + 20 * 60 + 59) * S), "5h20m");
        assert_eq!(age(now, now - (2 * 86_400 + 3 * 3_600) * S), "2d3h");
        // A clock running behind the server's: "now", not negative.
        assert_eq!(age(now, now + 10 * S), "0ms");
    }

    #[test]
    fn durations() {
        assert_eq!(duration(0), "0µs");
        assert_eq!(duration(640_000), "640µs");
        assert_eq!(duration(35_400_000), "35ms");
        assert_eq!(duration(1_250_000_000), "1.2s");
        assert_eq!(duration(59_990_000_000), "59.9s");
        assert_eq!(duration(125_000_000_000), "2m5s");
    }

    #[test]
    fn fields_align_and_continue_lines() {
        assert_eq!(fields([]), "");
        assert_eq!(
            fields([
                ("A", "1".to_string()),
                ("LONGER", String::new()),
                ("B", "x\ny".to_string())
            ]),
            "A       1\nLONGER  -\nB       x\n        y\n"
        );
    }

    #[test]
    fn truncation_counts_characters() {
        assert_eq!(truncate("", 3), "");
        assert_eq!(truncate("abc", 3), "abc");
        assert_eq!(truncate("abcd", 3), "ab…");
        assert_eq!(truncate("äöüß", 3), "äö…");
    }
}
