//! Pod to pod across the nodes of the real cluster (issue 18: Rivet routes
//! between nodes with the CRD store), checked from inside the pods with
//! `kubectl exec`, so other tests on the same cluster reuse it:
//!
//! - [`reaches`]: a pod pings an address and gets a line echoed over TCP;
//! - [`echoes`]: a pod gets a line echoed over TCP.
//!
//! Used by `tests/kube_deploy.rs`.

use std::net::IpAddr;
use std::process::Command;

/// `kubectl exec <pod> -- sh -c <script>` with the command `kubectl`
/// makes: stdout, or stdout and stderr of a failure.
fn exec(kubectl: &dyn Fn() -> Command, pod: &str, script: &str) -> Result<String, String> {
    let out = kubectl()
        .args(["exec", pod, "--", "sh", "-c", script])
        .output()
        .map_err(|e| format!("running kubectl exec {pod}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// Pod `from` pings `to` (3 echo requests, every reply back) and gets a
/// line echoed by `to`'s TCP `port` (a pod echoing TCP back); `Err` says which
/// failed and what the pod printed.
pub fn reaches(kubectl: &dyn Fn() -> Command, from: &str, to: IpAddr, port: u16) -> Result<(), String> {
    let ping = exec(kubectl, from, &format!("ping -c 3 -W 3 {to}")).map_err(|e| format!("{from} pings {to}: {e}"))?;
    if !ping.contains("3 packets received") {
        return Err(format!("{from} pings {to}: {ping}"));
    }
    echoes(kubectl, from, to, port)
}

/// Pod `from` gets a line echoed by `to`'s TCP `port` (a 3 s connect
/// timeout).
pub fn echoes(kubectl: &dyn Fn() -> Command, from: &str, to: IpAddr, port: u16) -> Result<(), String> {
    let line = format!("from-{from}");
    let out = exec(kubectl, from, &format!("echo {line} | timeout 6 nc -w 3 {to} {port}"))
        .map_err(|e| format!("{from} → {to}:{port} over TCP: {e}"))?;
    if out.trim() == line {
        Ok(())
    } else {
        Err(format!("{from} → {to}:{port} over TCP echoed {out:?}"))
    }
}
