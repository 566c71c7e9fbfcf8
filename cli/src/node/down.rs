//! `rivet node down`: the supervisor stopped, or its cleanup done from node.json.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::{ALL_DAEMONS, NODE_FILE, NodePhase, NodeRecord};
use crate::{netns, pod};

/// Whether `pid` is a live `rivet ... node up` (not a zombie, not a reused pid).
pub fn supervisor_alive(pid: u32) -> bool {
    process_alive(pid) && cmdline(pid).is_some_and(|args| args.iter().any(|a| a == "up"))
}

/// Whether `pid` runs (a zombie does not).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

pub(super) async fn down(state_dir: &Path, timeout: Duration) -> Result<bool> {
    let Some(record) = NodeRecord::load(state_dir)? else {
        println!("no node recorded in {}: nothing to stop", state_dir.display());
        return Ok(true);
    };
    let pid = record.supervisor_pid;
    if supervisor_alive(pid) {
        println!("stopping node {} (supervisor pid {pid})", record.node_name);
        // A background supervisor reports its teardown in node.log: show it.
        let log = record.log_dir.join("node.log");
        let offset = std::fs::metadata(&log).map_or(0, |m| m.len());
        kill(Pid::from_raw(pid as i32), Signal::SIGTERM).with_context(|| format!("signalling pid {pid}"))?;
        let deadline = Instant::now() + timeout;
        while supervisor_alive(pid) {
            if Instant::now() >= deadline {
                bail!(
                    "the supervisor (pid {pid}) is still stopping after {}s; see {}",
                    timeout.as_secs(),
                    record.log_dir.join("node.log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if let Ok(text) = std::fs::read(&log) {
            let start = usize::try_from(offset).unwrap_or(usize::MAX).min(text.len());
            for line in String::from_utf8_lossy(&text[start..]).lines() {
                let line = line.strip_prefix("rivet node: ").unwrap_or(line);
                if !line.starts_with("stopping node")
                    && !line.starts_with(&format!("node {} stopped", record.node_name))
                {
                    println!("  {line}");
                }
            }
        }
    }
    // A clean stop removed node.json last; if it is still there, the
    // supervisor died without cleaning up: do it from the record.
    if let Some(record) = NodeRecord::load(state_dir)? {
        println!(
            "the supervisor (pid {pid}) is gone without cleaning up; cleaning up node {}",
            record.node_name
        );
        let mut record = record;
        record.phase = NodePhase::Stopping;
        for message in before_daemons_stop(&record).await {
            println!("  {message}");
        }
        let grace = Duration::from_secs(record.stop_grace_seconds);
        for daemon in record.daemons.iter().rev() {
            if let Some(pid) = daemon.pid
                && process_alive(pid)
                && cmdline(pid).is_some_and(|args| args.iter().any(|a| a.ends_with(&daemon.name)))
            {
                stop_pid(pid, grace).await;
                println!("  stopped {} (pid {pid})", daemon.name);
            }
        }
        for message in after_daemons_stop(&record) {
            println!("  {message}");
        }
    }
    println!("node {} stopped", record.node_name);
    Ok(true)
}

/// SIGTERM to a process that is not our child, SIGKILL after `grace`.
async fn stop_pid(pid: u32, grace: Duration) {
    let target = Pid::from_raw(pid as i32);
    let _ = kill(target, Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while process_alive(pid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if process_alive(pid) {
        let _ = kill(target, Signal::SIGKILL);
    }
}

/// Teardown before the daemons stop: no new pods (the conflist goes), and
/// the test pods are deleted while the daemons can still answer DEL.
pub(super) async fn before_daemons_stop(record: &NodeRecord) -> Vec<String> {
    let mut messages = Vec::new();
    // While the conflist and the daemons are there: DEL needs both.
    if let Some(ns) = record.health_netns.clone() {
        let record = record.clone();
        match tokio::task::spawn_blocking(move || {
            super::health::detach(
                &ns,
                &record.conflist,
                &record.cni_bin_dir,
                record.netns_path.clone(),
                &record.log_dir,
            )
        })
        .await
        {
            Ok(m) => messages.extend(m),
            Err(e) => messages.push(format!("deleting the health endpoint: {e}")),
        }
    }
    remove_file(&record.conflist, &mut messages);
    let state_dir = record.state_dir.clone();
    match tokio::task::spawn_blocking(move || pod::delete_all(&state_dir, Duration::from_secs(60))).await {
        Ok(m) => messages.extend(m),
        Err(e) => messages.push(format!("deleting pods: {e}")),
    }
    messages
}

/// Teardown once the daemons are gone: the installed plugin, the pins, the
/// sockets, the namespace and node.json.
pub(super) fn after_daemons_stop(record: &NodeRecord) -> Vec<String> {
    let mut messages = Vec::new();
    remove_file(&record.cni_binary, &mut messages);
    for plugin in &record.cni_plugins {
        remove_file(plugin, &mut messages);
    }
    match std::fs::remove_dir_all(&record.pin_dir) {
        Ok(()) => messages.push(format!("removed pins {}", record.pin_dir.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => messages.push(format!("removing pins {}: {e}", record.pin_dir.display())),
    }
    for daemon in ALL_DAEMONS {
        let socket = rivet_common::socket::socket_path(&record.socket_dir, daemon);
        let mut quiet = Vec::new();
        remove_file(&socket, &mut quiet);
        remove_file(&rivet_common::socket::lock_path(&socket), &mut quiet);
    }
    if record.socket_dir_created {
        let _ = std::fs::remove_dir(&record.socket_dir);
    }
    if record.netns_created
        && let Some(ns) = &record.netns
    {
        match netns::delete(ns) {
            Ok(()) => messages.push(format!("deleted network namespace {ns}")),
            Err(e) => messages.push(format!("{e:#}")),
        }
    }
    remove_file(&record.state_dir.join(NODE_FILE), &mut Vec::new());
    messages
}

fn remove_file(path: &Path, messages: &mut Vec<String>) {
    match std::fs::remove_file(path) {
        Ok(()) => messages.push(format!("removed {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => messages.push(format!("removing {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_of_processes() {
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(u32::MAX - 1));
        // The test binary is not a `rivet node up`.
        assert!(!supervisor_alive(std::process::id()));
    }
}
