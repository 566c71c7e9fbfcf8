//! Pod to pod across the nodes of the real cluster (issue 18: Rivet routes
//! between nodes with the CRD store), checked from inside the pods with
//! `kubectl exec`, so other tests on the same cluster reuse it:
//!
//! - [`echo_pod`]: a busybox pod pinned to a node that echoes every TCP
//!   connection on a port (`nc -ll -e /bin/cat`);
//! - [`reaches`]: a pod pings an address and gets a line echoed over TCP;
//! - [`pods_reach_each_other`]: [`reaches`] both ways between two pods.
//!
//! Used by `tests/kube_cross_node.rs`.

use std::net::IpAddr;
use std::process::Command;

use crate::image::BUSYBOX_IMAGE;

/// Pod `name` in `default` on `node` with `labels`, echoing every TCP
/// connection on `port` back to its sender.
pub fn echo_pod(name: &str, node: &str, labels: serde_json::Value, port: u16) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": "default", "labels": labels },
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "echo",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["nc", "-ll", "-p", port.to_string(), "-e", "/bin/cat"]
            }]
        }
    })
}

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
/// line echoed by `to`'s TCP `port` (an [`echo_pod`]); `Err` says which
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

/// [`reaches`] both ways between the pods `a` and `b` (name, address).
pub fn pods_reach_each_other(
    kubectl: &dyn Fn() -> Command,
    a: (&str, IpAddr),
    b: (&str, IpAddr),
    port: u16,
) -> Result<(), String> {
    reaches(kubectl, a.0, b.1, port)?;
    reaches(kubectl, b.0, a.1, port)
}
