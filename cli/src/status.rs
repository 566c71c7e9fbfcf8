//! `rivet status`: every daemon socket — reachable, boot id, version.

use std::time::Duration;

use rivet_proto::daemon::v1::{GetInfoRequest, daemon_client::DaemonClient};
use serde::Serialize;

use crate::table::Table;
use crate::{Context, DAEMONS, connect};

/// One daemon's status.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DaemonStatus {
    /// Daemon name.
    pub daemon: String,
    /// Socket path.
    pub socket: String,
    /// `running`, `not running` (no socket) or `unreachable` (socket does not answer).
    pub state: String,
    /// Boot id of the answering process.
    pub boot_id: Option<String>,
    /// Its version.
    pub version: Option<String>,
    /// Node it serves.
    pub node_name: Option<String>,
    /// Its pid.
    pub pid: Option<u32>,
    /// Why it is unreachable.
    pub error: Option<String>,
}

/// Probes every daemon; a socket that exists but does not answer is a
/// failure (exit status 1), a missing one only means "not running".
pub async fn run(ctx: &Context) -> anyhow::Result<bool> {
    let mut all = Vec::new();
    for daemon in DAEMONS {
        all.push(probe(ctx, daemon).await);
    }
    ctx.print(&all, || {
        let mut t = Table::new(["DAEMON", "STATE", "VERSION", "PID", "BOOT ID", "SOCKET"]);
        for s in &all {
            t.row([
                s.daemon.clone(),
                match &s.error {
                    Some(e) => format!("{} ({e})", s.state),
                    None => s.state.clone(),
                },
                s.version.clone().unwrap_or_else(|| "-".into()),
                s.pid.map_or("-".into(), |p| p.to_string()),
                s.boot_id.clone().unwrap_or_else(|| "-".into()),
                s.socket.clone(),
            ]);
        }
        t.render()
    });
    Ok(all.iter().all(|s| s.state != "unreachable"))
}

async fn probe(ctx: &Context, daemon: &str) -> DaemonStatus {
    let path = ctx.socket(daemon);
    let mut status = DaemonStatus {
        daemon: daemon.to_string(),
        socket: path.display().to_string(),
        state: "not running".into(),
        boot_id: None,
        version: None,
        node_name: None,
        pid: None,
        error: None,
    };
    if !path.exists() {
        return status;
    }
    // A socket file exists: the daemon should answer quickly.
    let info = async {
        let channel = connect(&path, ctx.timeout.min(Duration::from_secs(2)))
            .await
            .map_err(|e| e.to_string())?;
        DaemonClient::new(channel)
            .get_info(GetInfoRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|s| s.message().to_string())
    }
    .await;
    match info {
        Ok(info) => {
            status.state = "running".into();
            status.boot_id = Some(info.boot_id);
            status.version = Some(info.version);
            status.node_name = Some(info.node_name);
            status.pid = Some(info.pid);
        }
        Err(e) => {
            status.state = "unreachable".into();
            status.error = Some(e);
        }
    }
    status
}
