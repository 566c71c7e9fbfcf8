//! Shared by the cross-process tests: a node (svc-endpoint's
//! [`EndpointNode`]: node namespace, svc-loader in it, svc-identity,
//! svc-ipam, svc-endpoint) and the real rivet-cni binary run inside the node
//! namespace the way a runtime runs it (`nsenter --net=<node ns>`, a clean
//! environment with the `CNI_*` variables, the netconf on stdin), against pod
//! namespaces the test owns. Running the binary, the netconf, the
//! environment and pods are `rivet_testkit::cni`'s (shared with the `cni`
//! benchmark); this adds the node and what the tests inspect on it.

#![allow(dead_code)]

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rivet_common::testing::netns::NetNs;
use rivet_common::testing::workspace_binary;
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::loader::v1 as ldpb;
use rivet_proto::net::format_address;
pub use rivet_testkit::cni::{CniRun, Pod};
use rivet_testkit::cni::{cni_env, exec_in_netns, node_conf};
use rivet_testkit::node::{EndpointNode, NodeOptions};
use serde_json::Value;

/// Host veth prefix the node's svc-loader acts on.
pub const PREFIX: &str = "rvh";

/// The node's gateways (first host addresses of its svc-ipam pool).
pub const GATEWAY4: &str = "198.18.0.1";
pub const GATEWAY6: &str = "2001:2::1";

/// What a node holds of pods: allocations, endpoints of svc-endpoint and of
/// the loader (map entries), host veths.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    pub allocations: Vec<String>,
    pub endpoints: Vec<String>,
    pub loader_entries: Vec<String>,
    pub loader_orphans: Vec<String>,
    pub host_veths: Vec<String>,
}

impl Leftovers {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A node and the binary.
pub struct Harness {
    pub node: EndpointNode,
    pub bin: PathBuf,
    pub log_file: PathBuf,
}

impl Harness {
    pub async fn start() -> Self {
        Self::start_with(NodeOptions::default()).await
    }

    pub async fn start_with(options: NodeOptions) -> Self {
        let node = EndpointNode::start(options).await.expect("the node's daemons start");
        let log_file = node.node.dir.path().join("rivet-cni.log");
        Self {
            node,
            bin: workspace_binary("rivet-cni"),
            log_file,
        }
    }

    /// The node namespace.
    pub fn node_ns(&self) -> &NetNs {
        &self.node.node.node.ns
    }

    /// A netconf for this node in `version` (debug logs in [`Self::log_file`]).
    pub fn conf(&self, version: &str) -> Value {
        node_conf(version, &self.node.sockets(), PREFIX, &self.log_file, Some("debug"))
    }

    /// The runtime's environment for an attachment verb.
    pub fn env(command: &str, pod: &Pod, ifname: &str) -> Vec<(String, String)> {
        cni_env(command, &pod.id, &pod.path(), ifname)
    }

    /// Runs `bin` in the node namespace with exactly `env` (plus PATH) and
    /// `stdin`.
    pub async fn exec_bin(&self, bin: &Path, env: &[(String, String)], stdin: &[u8]) -> CniRun {
        exec_in_netns(&self.node_ns().path(), bin, env, stdin, Duration::from_secs(90))
            .await
            .unwrap_or_else(|e| panic!("running {} under nsenter within 90 s: {e}", bin.display()))
    }

    /// Runs rivet-cni.
    pub async fn exec(&self, env: &[(String, String)], stdin: &Value) -> CniRun {
        self.exec_bin(&self.bin, env, stdin.to_string().as_bytes()).await
    }

    /// Runs rivet-cni for `command` on `pod`'s `eth0`.
    pub async fn cni(&self, command: &str, pod: &Pod, conf: &Value) -> CniRun {
        self.exec(&Self::env(command, pod, "eth0"), conf).await
    }

    /// Runs rivet-cni's GC (no attachment: only `CNI_COMMAND` and the
    /// reference plugins' `CNI_PATH`) with `conf`.
    pub async fn gc(&self, conf: &Value) -> CniRun {
        let env = [
            ("CNI_COMMAND".to_string(), "GC".to_string()),
            ("CNI_PATH".to_string(), "/usr/lib/cni".to_string()),
        ];
        self.exec(&env, conf).await
    }

    pub async fn add(&self, pod: &Pod, version: &str) -> Value {
        self.cni("ADD", pod, &self.conf(version)).await.ok()
    }

    pub async fn del(&self, pod: &Pod, version: &str) {
        self.cni("DEL", pod, &self.conf(version)).await.ok();
    }

    /// svc-endpoint's endpoint of `pod`'s eth0.
    pub async fn endpoint(&self, pod: &Pod) -> Option<eppb::Endpoint> {
        let request = eppb::GetEndpointRequest {
            r#ref: Some(eppb::EndpointRef {
                r#ref: Some(eppb::endpoint_ref::Ref::Container(eppb::ContainerInterface {
                    container_id: pod.id.clone(),
                    interface: "eth0".into(),
                })),
            }),
        };
        match self.node.endpoints().await.get_endpoint(request).await {
            Ok(r) => r.into_inner().endpoint,
            Err(s) if s.code() == tonic::Code::NotFound => None,
            Err(s) => panic!("GetEndpoint: {s}"),
        }
    }

    /// Host veths with the test prefix in the node namespace.
    pub fn host_veths(&self) -> Vec<String> {
        let out = self.node_ns().ip(&["-o", "link", "show"]).unwrap();
        out.lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap().to_string())
            .filter(|n| n.starts_with(PREFIX))
            .collect()
    }

    pub async fn allocations(&self) -> Vec<ipampb::Allocation> {
        self.node.allocations().await
    }

    pub async fn endpoints(&self) -> Vec<eppb::Endpoint> {
        self.node
            .endpoints()
            .await
            .list_endpoints(eppb::ListEndpointsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .endpoints
    }

    pub async fn leftovers(&self) -> Leftovers {
        let loader = self
            .node
            .node
            .client()
            .await
            .list_endpoints(ldpb::ListEndpointsRequest {})
            .await
            .unwrap()
            .into_inner();
        Leftovers {
            allocations: self
                .allocations()
                .await
                .iter()
                .map(|a| format!("{} ({:?})", format_address(&a.address), a.owner))
                .collect(),
            endpoints: self
                .endpoints()
                .await
                .iter()
                .map(|e| format!("{} {}/{}", e.id, e.container_id, e.interface))
                .collect(),
            loader_entries: loader.endpoints.iter().map(|e| format!("{e:?}")).collect(),
            loader_orphans: loader
                .orphan_attachments
                .iter()
                .map(|o| o.host_ifname.clone())
                .chain(
                    loader
                        .orphan_policy_endpoint_ids
                        .iter()
                        .map(|id| format!("policy of {id}")),
                )
                .collect(),
            host_veths: self.host_veths(),
        }
    }

    #[track_caller]
    pub fn assert_clean(&self, leftovers: &Leftovers, context: &str) {
        assert!(
            leftovers.is_empty(),
            "{context}: something was left behind: {leftovers:#?}\nrivet-cni log:\n{}",
            self.log_tail()
        );
    }

    /// The last lines of rivet-cni's log file.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log_file).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

/// The addresses of a result's `ips`, without prefix length.
#[track_caller]
pub fn result_ips(result: &Value) -> Vec<IpAddr> {
    rivet_testkit::cni::result_ips(result).unwrap_or_else(|| panic!("a result with addresses: {result}"))
}

/// Pings `dst` from `from` (3 packets); how many came back.
pub fn ping(from: &NetNs, dst: IpAddr) -> u32 {
    from.ping(dst, 3, Duration::from_millis(20), Duration::from_secs(2))
        .expect("the harness can ping")
        .received
}

/// Median and maximum of durations.
pub fn median_max(mut times: Vec<Duration>) -> (Duration, Duration) {
    times.sort();
    (times[times.len() / 2], *times.last().unwrap())
}
