//! `rivet status`: every daemon socket — reachable, boot id, version — and
//! what svc-endpoint reports about restore, endpoints, policy and its links
//! to the other daemons.

use std::time::Duration;

use rivet_proto::daemon::v1::{GetInfoRequest, daemon_client::DaemonClient};
use rivet_proto::endpoint::v1 as endpoint_pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use serde::Serialize;

use crate::endpoint::state_name;
use crate::table::Table;
use crate::{Context, DAEMONS, age, connect, duration, now_unix_nanos, truncate};

/// The daemon that also answers `GetStatus`.
const ENDPOINT_DAEMON: &str = "svc-endpoint";

/// Characters of a boot id shown for a dependency.
const SHORT_BOOT_ID: usize = 8;

/// Widest LAST ERROR cell of a dependency.
const ERROR_WIDTH: usize = 60;

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
    /// Why it is unreachable, or why its detailed status could not be read.
    pub error: Option<String>,
    /// svc-endpoint's detailed status, when it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint_status: Option<EndpointStatus>,
}

/// svc-endpoint's restore progress.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RestoreView {
    /// `running`, `complete` or `unknown`.
    pub phase: String,
    /// State dirs found at start.
    pub found: u32,
    /// Regenerated and ready.
    pub restored: u32,
    /// Dropped because the interface or pod is gone.
    pub dropped: u32,
    /// Failed to restore.
    pub failed: u32,
    /// Start, Unix nanoseconds.
    pub started_unix_nanos: i64,
    /// End, Unix nanoseconds; 0 while running.
    pub finished_unix_nanos: i64,
}

/// How many endpoints are in one state.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct StateCountView {
    /// State name.
    pub state: String,
    /// Endpoints in it.
    pub count: u32,
}

/// svc-endpoint's link to a daemon it drives.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DependencyView {
    /// The daemon.
    pub name: String,
    /// Whether svc-endpoint is connected to it.
    pub connected: bool,
    /// Its boot id as svc-endpoint last saw it.
    pub seen_boot_id: String,
    /// Last completed replay of desired state, Unix nanoseconds; 0 never.
    pub last_resync_unix_nanos: i64,
    /// Its last error.
    pub last_error: String,
}

/// What svc-endpoint reports in `GetStatus`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct EndpointStatus {
    /// Restore progress.
    pub restore: RestoreView,
    /// Endpoints by state.
    pub endpoints_by_state: Vec<StateCountView>,
    /// Current policy repository revision.
    pub policy_revision: u64,
    /// Policies stored.
    pub policies: u32,
    /// Links to the daemons it drives.
    pub dependencies: Vec<DependencyView>,
}

impl From<&endpoint_pb::GetStatusResponse> for EndpointStatus {
    fn from(r: &endpoint_pb::GetStatusResponse) -> Self {
        let restore = r.restore.unwrap_or_default();
        Self {
            restore: RestoreView {
                phase: match endpoint_pb::RestorePhase::try_from(restore.phase) {
                    Ok(endpoint_pb::RestorePhase::Running) => "running",
                    Ok(endpoint_pb::RestorePhase::Complete) => "complete",
                    _ => "unknown",
                }
                .into(),
                found: restore.found,
                restored: restore.restored,
                dropped: restore.dropped,
                failed: restore.failed,
                started_unix_nanos: restore.started_unix_nanos,
                finished_unix_nanos: restore.finished_unix_nanos,
            },
            endpoints_by_state: r
                .endpoints_by_state
                .iter()
                .map(|c| StateCountView {
                    state: state_name(c.state).into(),
                    count: c.count,
                })
                .collect(),
            policy_revision: r.policy_revision,
            policies: r.policies,
            dependencies: r
                .dependencies
                .iter()
                .map(|d| DependencyView {
                    name: d.name.clone(),
                    connected: d.connected,
                    seen_boot_id: d.seen_boot_id.clone(),
                    last_resync_unix_nanos: d.last_resync_unix_nanos,
                    last_error: d.last_error.clone(),
                })
                .collect(),
        }
    }
}

/// The svc-endpoint section of `rivet status`, indented under its name.
fn endpoint_section(s: &EndpointStatus, now: i64) -> String {
    let r = &s.restore;
    let counts = format!(
        "{} found, {} restored, {} dropped, {} failed",
        r.found, r.restored, r.dropped, r.failed
    );
    let restore = match r.phase.as_str() {
        "running" => format!("running for {}: {counts}", age(now, r.started_unix_nanos)),
        "complete" if r.started_unix_nanos > 0 && r.finished_unix_nanos >= r.started_unix_nanos => {
            let took = (r.finished_unix_nanos - r.started_unix_nanos).unsigned_abs();
            format!("complete in {}: {counts}", duration(took))
        }
        phase => format!("{phase}: {counts}"),
    };
    let by_state: Vec<String> = s
        .endpoints_by_state
        .iter()
        .filter(|c| c.count > 0)
        .map(|c| format!("{} {}", c.count, c.state))
        .collect();
    let mut body = crate::fields([
        ("restore", restore),
        (
            "endpoints",
            if by_state.is_empty() {
                "none".into()
            } else {
                by_state.join(", ")
            },
        ),
        (
            "policy",
            format!(
                "revision {}, {} {}",
                s.policy_revision,
                s.policies,
                if s.policies == 1 { "policy" } else { "policies" }
            ),
        ),
    ]);
    if !s.dependencies.is_empty() {
        let mut t = Table::new(["DEPENDENCY", "CONNECTED", "SEEN BOOT ID", "LAST RESYNC", "LAST ERROR"]);
        for d in &s.dependencies {
            t.row([
                d.name.clone(),
                if d.connected { "yes" } else { "no" }.into(),
                if d.seen_boot_id.is_empty() {
                    "-".into()
                } else {
                    d.seen_boot_id.chars().take(SHORT_BOOT_ID).collect()
                },
                if d.last_resync_unix_nanos == 0 {
                    "never".into()
                } else {
                    format!("{} ago", age(now, d.last_resync_unix_nanos))
                },
                if d.last_error.is_empty() {
                    "-".into()
                } else {
                    truncate(
                        &d.last_error.split_whitespace().collect::<Vec<_>>().join(" "),
                        ERROR_WIDTH,
                    )
                },
            ]);
        }
        body.push_str(&t.render());
    }
    let mut out = format!("\n{ENDPOINT_DAEMON}:\n");
    for line in body.lines() {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
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
        let mut out = t.render();
        let now = now_unix_nanos();
        for s in &all {
            if let Some(endpoint) = &s.endpoint_status {
                out.push_str(&endpoint_section(endpoint, now));
            }
        }
        out
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
        endpoint_status: None,
    };
    if !path.exists() {
        return status;
    }
    // A socket file exists: the daemon should answer quickly.
    let info = async {
        let channel = connect(&path, ctx.timeout.min(Duration::from_secs(2)))
            .await
            .map_err(|e| e.to_string())?;
        DaemonClient::new(channel.clone())
            .get_info(GetInfoRequest {})
            .await
            .map(|r| (r.into_inner(), channel))
            .map_err(|s| s.message().to_string())
    }
    .await;
    match info {
        Ok((info, channel)) => {
            if daemon == ENDPOINT_DAEMON {
                match EndpointServiceClient::new(channel)
                    .get_status(endpoint_pb::GetStatusRequest {})
                    .await
                {
                    Ok(r) => status.endpoint_status = Some((&r.into_inner()).into()),
                    Err(s) => status.error = Some(format!("GetStatus: {:?}: {}", s.code(), s.message())),
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    fn status() -> endpoint_pb::GetStatusResponse {
        endpoint_pb::GetStatusResponse {
            restore: Some(endpoint_pb::RestoreStatus {
                phase: endpoint_pb::RestorePhase::Complete as i32,
                found: 12,
                restored: 10,
                dropped: 1,
                failed: 1,
                started_unix_nanos: 100 * S,
                finished_unix_nanos: 100 * S + 1_250_000_000,
            }),
            endpoints_by_state: vec![
                endpoint_pb::StateCount {
                    state: endpoint_pb::EndpointState::Regenerating as i32,
                    count: 1,
                },
                endpoint_pb::StateCount {
                    state: endpoint_pb::EndpointState::Ready as i32,
                    count: 10,
                },
                endpoint_pb::StateCount {
                    state: endpoint_pb::EndpointState::Restoring as i32,
                    count: 0,
                },
            ],
            policy_revision: 42,
            policies: 7,
            dependencies: vec![
                endpoint_pb::Dependency {
                    name: "svc-identity".into(),
                    connected: true,
                    seen_boot_id: "3f2a9c1d-0000-4000-8000-000000000000".into(),
                    last_resync_unix_nanos: 400 * S,
                    last_error: String::new(),
                },
                endpoint_pb::Dependency {
                    name: "svc-loader".into(),
                    connected: false,
                    seen_boot_id: String::new(),
                    last_resync_unix_nanos: 0,
                    last_error: "connection refused".into(),
                },
            ],
            boot_id: "b".into(),
        }
    }

    #[test]
    fn endpoint_section_is_short() {
        let view = EndpointStatus::from(&status());
        assert_eq!(
            endpoint_section(&view, 700 * S),
            "\nsvc-endpoint:\n\
             \x20 restore    complete in 1.2s: 12 found, 10 restored, 1 dropped, 1 failed\n\
             \x20 endpoints  1 regenerating, 10 ready\n\
             \x20 policy     revision 42, 7 policies\n\
             \x20 DEPENDENCY    CONNECTED  SEEN BOOT ID  LAST RESYNC  LAST ERROR\n\
             \x20 svc-identity  yes        3f2a9c1d      5m0s ago     -\n\
             \x20 svc-loader    no         -             never        connection refused\n"
        );
    }

    #[test]
    fn endpoint_section_while_restoring() {
        let mut r = status();
        r.restore = Some(endpoint_pb::RestoreStatus {
            phase: endpoint_pb::RestorePhase::Running as i32,
            found: 3,
            started_unix_nanos: 697 * S,
            ..Default::default()
        });
        r.endpoints_by_state.clear();
        r.policies = 1;
        r.dependencies.clear();
        let text = endpoint_section(&EndpointStatus::from(&r), 700 * S);
        assert!(text.contains("restore    running for 3s: 3 found, 0 restored, 0 dropped, 0 failed\n"));
        assert!(text.contains("endpoints  none\n"));
        assert!(text.ends_with("policy     revision 42, 1 policy\n"));
    }
}
