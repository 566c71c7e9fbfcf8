//! svc-endpoint: the unprivileged orchestrator of a node.

pub mod policy;

/// The daemon's name: its socket is `<socket-dir>/svc-endpoint.sock`.
pub const DAEMON_NAME: &str = "svc-endpoint";
