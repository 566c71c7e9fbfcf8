//! The node's health endpoint (`rivet node up --health-endpoint`): the
//! address svc-health serves `/hello` on for the other nodes' probes and
//! sends its own probes of their health endpoints from, through the pod
//! datapath. It is an endpoint like a pod's — a namespace `hlth-<node>`
//! wired by the real rivet-cni (veth, address from svc-ipam, svc-endpoint's
//! CreateEndpoint, the datapath attached) — so it survives every daemon's
//! restart as a pod does (svc-endpoint restores it). What makes it the
//! health endpoint is the netconf's `"endpointKind": "health"`, which
//! svc-endpoint accepts from root only and gives the reserved `health`
//! identity (4), whatever labels: no pod or namespace selector selects it,
//! so pod policies never cut it off (only a policy naming
//! `reserved:health` does). `node down` deletes it (CNI DEL) and its
//! namespace.
//!
//! The namespace is made before the daemons start (svc-health enters it at
//! start); the CNI ADD runs once they answer and rivet-cni is installed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::netns;
use crate::pod::{Attachment, CniRunner, NetworkConfigList};

/// The interface inside the health endpoint's namespace.
const IFNAME: &str = "eth0";

/// The health endpoint's namespace (and container id) of node `node`.
///
/// ```
/// assert_eq!(rivet_cli::node::health_netns("c-n1").unwrap(), "hlth-c-n1");
/// assert!(rivet_cli::node::health_netns(&"n".repeat(64)).is_err());
/// ```
pub fn health_netns(node: &str) -> Result<String> {
    let name = format!("hlth-{node}");
    netns::check_name(&name).with_context(|| format!("the health endpoint's namespace of node {node}"))?;
    Ok(name)
}

/// The installed network configuration with the health endpoint's kind.
fn network(conflist: &Path) -> Result<NetworkConfigList> {
    let mut list = NetworkConfigList::load(conflist)?;
    let Some(first) = list.plugins.first_mut() else {
        bail!("{} has no plugin", conflist.display());
    };
    first.insert("endpointKind".into(), Value::String("health".into()));
    Ok(list)
}

fn attachment(ns: &str) -> Attachment {
    Attachment {
        container_id: ns.to_string(),
        netns: netns::path(ns),
        ifname: IFNAME.into(),
        pod_namespace: String::new(),
        pod_name: String::new(),
        labels: Default::default(),
        ports: Vec::new(),
    }
}

fn runner(cni_bin_dir: &Path, node_netns: Option<PathBuf>, log_dir: &Path) -> CniRunner {
    CniRunner {
        cni_path: vec![cni_bin_dir.to_path_buf()],
        node_netns,
        timeout: Duration::from_secs(60),
        stderr_log: Some(log_dir.join("rivet-cni-health.log")),
    }
}

/// Makes the namespace `ns` (a leftover of a crashed node is removed
/// first: it is this node's by name).
pub fn create_namespace(ns: &str) -> Result<()> {
    netns::delete(ns)?;
    netns::create(ns)
}

/// CNI ADD of the health endpoint into `ns` through the installed conflist.
pub fn attach(
    ns: &str,
    conflist: &Path,
    cni_bin_dir: &Path,
    node_netns: Option<PathBuf>,
    log_dir: &Path,
) -> Result<()> {
    let list = network(conflist)?;
    runner(cni_bin_dir, node_netns, log_dir)
        .add(&list, &attachment(ns))
        .with_context(|| format!("creating the health endpoint in {ns}"))?;
    Ok(())
}

/// CNI DEL of the health endpoint (while the daemons still answer), then
/// its namespace; what was done or failed, for the teardown's report.
pub fn detach(
    ns: &str,
    conflist: &Path,
    cni_bin_dir: &Path,
    node_netns: Option<PathBuf>,
    log_dir: &Path,
) -> Vec<String> {
    let mut messages = Vec::new();
    match network(conflist) {
        Ok(list) => match runner(cni_bin_dir, node_netns, log_dir).del(&list, &attachment(ns), None) {
            Ok(()) => messages.push(format!("deleted the health endpoint in {ns}")),
            Err(e) => messages.push(format!("deleting the health endpoint in {ns}: {e}")),
        },
        Err(e) => messages.push(format!("deleting the health endpoint in {ns}: {e:#}")),
    }
    match netns::delete(ns) {
        Ok(()) => messages.push(format!("deleted network namespace {ns}")),
        Err(e) => messages.push(format!("{e:#}")),
    }
    messages
}
