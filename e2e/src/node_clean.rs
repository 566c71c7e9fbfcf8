//! Whether Rivet left anything on a worker of [`crate::kube_cluster`]
//! (issue 18 §4: "`kubectl delete -k deploy/` plus draining leaves nothing
//! on the nodes"; deploy/README.md "Uninstall").
//!
//! [`rivet_leftovers`] looks where deploy/ puts things, as the worker sees
//! them: its pins under its bpffs (`/sys/fs/bpf/rivet/<node>` of the
//! worker's own bpffs, [`Worker::host_path`]), `rivet-…` tc filters on any interface of
//! its network namespace, pods' veths (`lxc…`), `rivet_vxlan`, routes of
//! protocol 77, `rivet-cni` and `10-rivet.conflist` in its CNI dirs,
//! rivet-cni's log, and any socket or lock file in its socket dir.
//!
//! ```no_run
//! # fn t(cluster: &rivet_e2e::kube_cluster::KubeCluster) {
//! for worker in cluster.workers() {
//!     let left = rivet_e2e::node_clean::rivet_leftovers(worker);
//!     assert!(left.is_empty(), "{}: {left:#?}", worker.name);
//! }
//! # }
//! ```

use std::path::Path;

use crate::kube_cluster::Worker;

/// The pods' host veth prefix (deploy/'s `endpoint-interface-prefix`).
pub const ENDPOINT_INTERFACE_PREFIX: &str = "lxc";
/// The socket dir of deploy/ (`/var/run` is `/run` on the workers).
pub const SOCKET_DIR: &str = "/run/rivet/sockets";
/// rivet-cni's log file of deploy/.
pub const CNI_LOG: &str = "/run/rivet/rivet-cni.log";
/// The CNI files `rivet-cni install` writes.
pub const CNI_FILES: [&str; 2] = ["/opt/cni/bin/rivet-cni", "/etc/cni/net.d/10-rivet.conflist"];

/// Everything of Rivet still on `worker`, one line each ("what: where");
/// empty when the node is clean. A check that cannot run is a line too.
pub fn rivet_leftovers(worker: &Worker) -> Vec<String> {
    let mut left = Vec::new();
    let pins = worker.host_path(&format!("/sys/fs/bpf/rivet/{}", worker.name));
    if pins.exists() {
        left.push(format!("pin dir: {} ({:?})", pins.display(), entries(&pins)));
    }
    let ns = &worker.netns;
    match ns.ip(&["-o", "link", "show"]) {
        Ok(links) => {
            for name in links.lines().filter_map(link_name) {
                if name.starts_with(ENDPOINT_INTERFACE_PREFIX) || name == "rivet_vxlan" {
                    left.push(format!("interface: {name}"));
                }
                for hook in ["ingress", "egress"] {
                    match ns.run(&["tc", "filter", "show", "dev", name, hook]) {
                        Ok(filters) => left.extend(
                            filters
                                .lines()
                                .filter(|l| l.contains("rivet-"))
                                .map(|l| format!("tc filter: {name} {hook}: {}", l.trim())),
                        ),
                        Err(e) => left.push(format!("tc filter show dev {name} {hook} failed: {e}")),
                    }
                }
            }
        }
        Err(e) => left.push(format!("ip link show failed: {e}")),
    }
    for family in ["-4", "-6"] {
        match ns.ip(&[family, "route", "show", "proto", "77"]) {
            Ok(routes) => left.extend(routes.lines().map(|r| format!("route: {}", r.trim()))),
            Err(e) => left.push(format!("ip {family} route show proto 77 failed: {e}")),
        }
    }
    for file in CNI_FILES.iter().chain(&[CNI_LOG]) {
        let path = worker.host_path(file);
        if path.symlink_metadata().is_ok() {
            left.push(format!("CNI file: {file}"));
        }
    }
    let sockets = worker.host_path(SOCKET_DIR);
    for entry in entries(&sockets) {
        left.push(format!("socket dir entry: {SOCKET_DIR}/{entry}"));
    }
    left
}

/// `dev` of an `ip -o link show` line ("3: ul0@if4: <…>").
fn link_name(line: &str) -> Option<&str> {
    let name = line.split(": ").nth(1)?;
    Some(name.split('@').next().unwrap_or(name))
}

/// The names in `dir` (none if it is absent).
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    #[test]
    fn link_names_drop_the_peer_suffix() {
        assert_eq!(super::link_name("3: ul0@if4: <BROADCAST> mtu 1500"), Some("ul0"));
        assert_eq!(super::link_name("1: lo: <LOOPBACK,UP> mtu 65536"), Some("lo"));
        assert_eq!(super::link_name("garbage"), None);
    }
}
