//! Shared by the cross-process tests: a node (svc-endpoint's
//! [`EndpointNode`]: node namespace, svc-loader in it, svc-identity,
//! svc-ipam, svc-endpoint) and the real rivet-cni binary run inside the node
//! namespace the way a runtime runs it (`nsenter --net=<node ns>`, a clean
//! environment with the `CNI_*` variables, the netconf on stdin), against pod
//! namespaces the test owns.

#![allow(dead_code)]

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rivet_common::testing::netns::NetNs;
use rivet_common::testing::workspace_binary;
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::loader::v1 as ldpb;
use serde_json::{Value, json};
use svc_endpoint::testing::{EndpointNode, NodeOptions};
use tokio::io::AsyncWriteExt as _;

/// Host veth prefix the node's svc-loader acts on.
pub const PREFIX: &str = "rvh";

/// The node's gateways (first host addresses of its svc-ipam pool).
pub const GATEWAY4: &str = "198.18.0.1";
pub const GATEWAY6: &str = "2001:2::1";

/// One run of the binary.
#[derive(Debug)]
pub struct CniRun {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl CniRun {
    /// stdout as JSON (Null when empty).
    pub fn json(&self) -> Value {
        if self.stdout.trim().is_empty() {
            return Value::Null;
        }
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}\nstderr: {}", self.stdout, self.stderr))
    }

    /// Asserts success; stdout as JSON.
    #[track_caller]
    pub fn ok(&self) -> Value {
        assert!(
            self.status.success(),
            "rivet-cni failed ({}): {}\nstderr: {}",
            self.status,
            self.stdout,
            self.stderr
        );
        self.json()
    }

    /// Asserts failure with the spec's error JSON; the error.
    #[track_caller]
    pub fn err(&self) -> Value {
        assert!(
            !self.status.success(),
            "rivet-cni succeeded but should have failed: {}",
            self.stdout
        );
        let error = self.json();
        assert!(error["code"].is_u64(), "error JSON has a code: {error}");
        assert!(error["msg"].is_string(), "error JSON has a msg: {error}");
        assert!(error["cniVersion"].is_string(), "error JSON has a cniVersion: {error}");
        error
    }

    /// Asserts failure with `code`; the message.
    #[track_caller]
    pub fn err_code(&self, code: u64) -> String {
        let error = self.err();
        assert_eq!(error["code"], code, "{error}");
        error["msg"].as_str().unwrap().to_string()
    }
}

/// A pod namespace and the container id the test uses for it.
#[derive(Debug)]
pub struct Pod {
    pub ns: NetNs,
    pub id: String,
}

impl Pod {
    pub fn new(id: &str) -> Self {
        Self {
            ns: NetNs::new("rvp").expect("creating a pod namespace"),
            id: id.to_string(),
        }
    }

    pub fn path(&self) -> PathBuf {
        self.ns.path()
    }
}

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

    /// A netconf for this node in `version`.
    pub fn conf(&self, version: &str) -> Value {
        json!({
            "cniVersion": version,
            "name": "rivet",
            "type": "rivet-cni",
            "socketDir": self.node.sockets(),
            "hostInterfacePrefix": PREFIX,
            "logFile": self.log_file,
            "logLevel": "debug",
            "timeoutSeconds": 30,
        })
    }

    /// The runtime's environment for an attachment verb.
    pub fn env(command: &str, pod: &Pod, ifname: &str) -> Vec<(String, String)> {
        vec![
            ("CNI_COMMAND".into(), command.into()),
            ("CNI_CONTAINERID".into(), pod.id.clone()),
            ("CNI_NETNS".into(), pod.path().display().to_string()),
            ("CNI_IFNAME".into(), ifname.into()),
            ("CNI_PATH".into(), "/usr/lib/cni".into()),
            (
                "CNI_ARGS".into(),
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID=uid-{}",
                    pod.id, pod.id, pod.id
                ),
            ),
        ]
    }

    /// Runs `bin` in the node namespace with exactly `env` (plus PATH) and
    /// `stdin`.
    pub async fn exec_bin(&self, bin: &Path, env: &[(String, String)], stdin: &[u8]) -> CniRun {
        let started = Instant::now();
        let mut child = tokio::process::Command::new("nsenter")
            .arg(format!("--net={}", self.node_ns().path().display()))
            .arg(bin)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("running rivet-cni under nsenter");
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin).await.unwrap();
        drop(input);
        let output = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
            .await
            .expect("rivet-cni finishes within 90 s")
            .unwrap();
        CniRun {
            status: output.status,
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            elapsed: started.elapsed(),
        }
    }

    /// Runs rivet-cni.
    pub async fn exec(&self, env: &[(String, String)], stdin: &Value) -> CniRun {
        self.exec_bin(&self.bin, env, stdin.to_string().as_bytes()).await
    }

    /// Runs rivet-cni for `command` on `pod`'s `eth0`.
    pub async fn cni(&self, command: &str, pod: &Pod, conf: &Value) -> CniRun {
        self.exec(&Self::env(command, pod, "eth0"), conf).await
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
                .map(|a| format!("{} ({:?})", a.address, a.owner))
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
pub fn result_ips(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ip| {
            ip["address"]
                .as_str()
                .unwrap()
                .split('/')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
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
