//! `rivet pod del --force` while the CNI's DEL fails at svc-endpoint (issue
//! 12 §6): svc-identity hangs (SIGSTOP), so svc-endpoint cannot finish the
//! endpoint's removal within the CNI's deadline and rivet-cni keeps the
//! pod's addresses. Force removes the pod anyway; once svc-identity answers
//! again, svc-endpoint completes the removal by itself and releases the
//! addresses the CNI kept: nothing is leaked. (rivet-cni's own deadline can
//! cut the call before svc-endpoint's answers: a cancelled call counts as
//! a failed one.)
//!
//! Needs root, a bpffs at /sys/fs/bpf, the rivet users (`cargo xtask
//! install`) and the workspace binaries beside `rivet` (`cargo build
//! --bins`). Addresses come from 198.18.0.0/15 and 2001:2::/48 only.

use std::process::Command;
use std::time::Duration;

use support::{TestNode, eventually};

mod support;

/// Resumes a stopped process on drop, even when the test fails.
struct Stopped(u32);

impl Stopped {
    fn stop(pid: u32) -> Self {
        signal("-STOP", pid);
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(which: &str, pid: u32) {
    let status = Command::new("kill").args([which, &pid.to_string()]).status().unwrap();
    assert!(status.success(), "kill {which} {pid}");
}

#[test]
fn a_forced_delete_whose_cni_del_failed_leaks_nothing_once_svc_identity_answers() {
    let mut node = TestNode::up();
    node.ok(&["pod", "add", "forced", "--label", "app=forced"]);
    node.ok(&["pod", "add", "stays", "--label", "app=stays"]);
    let addresses = node.addresses("forced");
    assert_eq!(addresses.len(), 2, "a dual-stack pod: {addresses:?}");
    let identity = node
        .record()
        .daemon("svc-identity")
        .and_then(|d| d.pid)
        .expect("svc-identity runs");

    let hung = Stopped::stop(identity);
    let out = node
        .rivet(&["pod", "del", "forced", "--force", "--cni-timeout", "3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "--force removes the pod: {stderr}");
    assert!(
        stderr.contains("removing it anyway"),
        "the CNI DEL failed (svc-endpoint could not finish): {stderr}"
    );
    let endpoints = node.json(&["endpoint", "list"]).to_string();
    assert!(
        endpoints.contains("\"forced\"") && endpoints.to_lowercase().contains("disconnecting"),
        "svc-endpoint still holds the endpoint, disconnecting: {endpoints}"
    );
    let allocations = node.json(&["ipam", "list", "--allocations"]).to_string();
    assert!(
        addresses.iter().all(|a| allocations.contains(&format!("\"{a}/"))),
        "the CNI kept the addresses: {allocations}"
    );

    drop(hung);
    eventually(
        "svc-endpoint removes the endpoint and releases its addresses by itself",
        Duration::from_secs(60),
        || {
            let endpoints = node.json(&["endpoint", "list"]).to_string();
            let allocations = node.json(&["ipam", "list", "--allocations"]).to_string();
            !endpoints.contains("\"forced\"") && addresses.iter().all(|a| !allocations.contains(&format!("\"{a}/")))
        },
    );
    assert!(node.ping("stays", &node.ipv4("stays")), "the other pod still works");
    node.down_and_check_nothing_left();
}
