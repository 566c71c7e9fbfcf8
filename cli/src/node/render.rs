//! Printing a node: `rivet node status` and the supervision part of `rivet status`.

use rivet_common::privileges::CapabilityList;

use super::{NodePhase, NodeRecord, supervisor_alive};
use crate::table::Table;
use crate::{age, now_unix_nanos};

/// The supervisor's view in `rivet status`: one line about the node, then
/// each daemon's state, restarts and last exit.
pub fn describe_supervision(r: &NodeRecord) -> String {
    let now = now_unix_nanos();
    let mut out = format!(
        "node {} (netns {}, supervisor pid {}{}, up {}):\n",
        r.node_name,
        r.netns.as_deref().unwrap_or("-"),
        r.supervisor_pid,
        gone(r),
        age(now, r.started_unix_nanos)
    );
    let mut t = Table::new(["DAEMON", "STATE", "RESTARTS", "LAST EXIT"]);
    for d in &r.daemons {
        t.row([
            d.name.clone(),
            d.phase.as_str().into(),
            d.restarts.to_string(),
            match &d.last_exit {
                Some(exit) => format!("{exit}, {} ago", age(now, d.last_exit_unix_nanos)),
                None => "-".into(),
            },
        ]);
    }
    for line in t.render().lines() {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// ` NOT RUNNING (...)` when the recorded supervisor is gone.
fn gone(r: &NodeRecord) -> String {
    if r.supervisor_pid == std::process::id() || supervisor_alive(r.supervisor_pid) {
        String::new()
    } else {
        format!(
            " NOT RUNNING (clean up with `rivet --state-dir {} node down`)",
            r.state_dir.display()
        )
    }
}

/// The user and effective capabilities process `pid` runs with (from
/// `/proc/<pid>/status`: what the daemon dropped to, not what it was told).
fn running_as(pid: u32) -> Option<(String, String)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let uid: u32 = field("Uid:")?.split_whitespace().nth(1)?.parse().ok()?;
    let mask = u64::from_str_radix(field("CapEff:")?, 16).ok()?;
    let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or_else(|| uid.to_string(), |u| u.name);
    Some((user, CapabilityList::from_mask(mask).short()))
}

/// The node for people: where things are, then a table of the daemons.
pub fn describe_node(r: &NodeRecord) -> String {
    let now = now_unix_nanos();
    let netns = match &r.netns {
        Some(ns) if r.netns_created => format!("{ns} (created; lo: {})", r.node_addresses.join(", ")),
        Some(ns) => ns.clone(),
        None => "- (the host's)".into(),
    };
    let phase = match r.phase {
        NodePhase::Starting => "starting",
        NodePhase::Running => "running",
        NodePhase::Stopping => "stopping",
    };
    let mut out = format!(
        "node {}: {phase} for {}, supervisor pid {}{}\n",
        r.node_name,
        age(now, r.started_unix_nanos),
        r.supervisor_pid,
        gone(r)
    );
    let body = crate::fields([
        ("netns", netns),
        ("pools", r.pools.join(" ")),
        ("sockets", r.socket_dir.display().to_string()),
        ("state", r.state_dir.display().to_string()),
        ("logs", r.log_dir.display().to_string()),
        ("pins", r.pin_dir.display().to_string()),
        (
            "cni",
            std::iter::once(&r.conflist)
                .chain(std::iter::once(&r.cni_binary))
                .chain(&r.cni_plugins)
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join("\n"),
        ),
    ]);
    let mut t = Table::new([
        "DAEMON",
        "STATE",
        "PID",
        "RESTARTS",
        "UP",
        "LAST EXIT",
        "USER",
        "CAPABILITIES",
    ]);
    for d in &r.daemons {
        let (user, capabilities) = d.pid.and_then(running_as).unwrap_or(("-".into(), "-".into()));
        t.row([
            d.name.clone(),
            d.phase.as_str().into(),
            d.pid.map_or("-".into(), |p| p.to_string()),
            d.restarts.to_string(),
            if d.pid.is_some() {
                age(now, d.started_unix_nanos)
            } else {
                "-".into()
            },
            match &d.last_exit {
                Some(exit) => format!("{exit}, {} ago", age(now, d.last_exit_unix_nanos)),
                None => "-".into(),
            },
            user,
            capabilities,
        ]);
    }
    for line in body.lines().chain(t.render().lines()) {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::DaemonPhase;
    use crate::node::plan::tests::{plan, test_accounts};

    #[test]
    fn node_is_described() {
        let p = plan(&["--netns", "rn1", "--create-netns"]).unwrap();
        let mut r = p.record(true, &p.specs(&test_accounts()));
        r.phase = NodePhase::Running;
        r.netns_created = true;
        r.daemons[3].pid = Some(42);
        r.daemons[3].phase = DaemonPhase::Running;
        r.daemons[3].restarts = 1;
        r.daemons[3].started_unix_nanos = now_unix_nanos();
        r.daemons[3].last_exit = Some("signal 9 (SIGKILL)".into());
        // 90.5 s ago: "1m30s" holds for the half second the rendering may take.
        r.daemons[3].last_exit_unix_nanos = now_unix_nanos() - 90_500_000_000;
        let text = describe_node(&r);
        assert!(text.starts_with("node rn1: running for "), "{text}");
        assert!(
            text.contains("netns    rn1 (created; lo: 198.19.0.1/32, 2001:2:0:ffff::1/128)"),
            "{text}"
        );
        assert!(text.contains("svc-endpoint  running  42   1"), "{text}");
        assert!(text.contains("signal 9 (SIGKILL), 1m30s ago"), "{text}");
        let brief = describe_supervision(&r);
        assert!(brief.starts_with("node rn1 (netns rn1, supervisor pid "), "{brief}");
        assert!(
            brief.contains("  svc-endpoint  running  1         signal 9 (SIGKILL), 1m30s ago\n"),
            "{brief}"
        );
        // node.json round trip.
        let dir = tempfile::tempdir().unwrap();
        r.state_dir = dir.path().to_path_buf();
        r.store().unwrap();
        assert_eq!(NodeRecord::load(dir.path()).unwrap(), Some(r));
    }
}
