//! `RivetNode`: one per node, cluster-scoped, named like the Node. The spec
//! says how to reach the node's pods (addresses, pod CIDRs, encapsulation);
//! the status says whether Rivet is ready there. Written by svc-k8s-sync for
//! its own node; read by the operator and other nodes (multi-node issues).

use k8s_openapi::api::core::v1::Taint;
use k8s_openapi::jiff::{self, Timestamp};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The spec of a `RivetNode` (`rivet.io/v1`), cluster-scoped; short name `rnode`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "rivet.io",
    version = "v1",
    kind = "RivetNode",
    shortname = "rnode",
    category = "rivet",
    status = "RivetNodeStatus",
    derive = "PartialEq",
    doc = "A node as Rivet sees it: addresses, pod CIDRs, encapsulation, readiness.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "PodCIDRs", type_ = "string", json_path = ".spec.podCidrs"),
    printcolumn(name = "Encapsulation", type_ = "string", json_path = ".spec.encapsulation.mode"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct RivetNodeSpec {
    /// The node's addresses.
    #[serde(default)]
    pub addresses: Vec<NodeAddress>,
    /// The prefixes the node's pods get addresses from.
    #[serde(default)]
    pub pod_cidrs: Vec<String>,
    /// How other nodes reach this node's pods.
    #[serde(default)]
    pub encapsulation: Encapsulation,
}

/// One node address.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct NodeAddress {
    /// `InternalIP`, `ExternalIP` (as in the Node's status).
    #[serde(rename = "type")]
    pub type_: String,
    /// The address.
    pub ip: String,
}

/// Encapsulation of pod traffic between nodes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct Encapsulation {
    /// Direct routing or VXLAN.
    pub mode: EncapsulationMode,
    /// The UDP port of the tunnel (VXLAN: 8472 by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

/// How pod traffic crosses nodes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EncapsulationMode {
    /// Routed natively (pod CIDRs are routable between nodes).
    #[default]
    Direct,
    /// VXLAN tunnels between nodes.
    Vxlan,
}

/// Whether Rivet is ready on the node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct RivetNodeStatus {
    /// `Ready` (every daemon ready, caches synced) and others, like a Node's
    /// conditions. A map keyed by `type` for server-side apply, so each
    /// writer owns its own conditions: svc-k8s-sync `Ready` and
    /// `PodCIDRsApplied`, the operator `PodCIDRsAllocated`.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<NodeCondition>,
}

/// Condition `Ready` (svc-k8s-sync): every daemon of the node ready and the
/// watch caches synced; its `lastHeartbeatTime` is refreshed while the agent
/// runs, so a stale one means the agent is gone.
pub const CONDITION_READY: &str = "Ready";
/// Condition `PodCIDRsAllocated` (operator): the cluster pool gave the node
/// its pod CIDRs, or why not (`ClusterPoolExhausted`).
pub const CONDITION_POD_CIDRS_ALLOCATED: &str = "PodCIDRsAllocated";
/// Condition `PodCIDRsApplied` (svc-k8s-sync): the node's svc-ipam serves
/// the pod CIDRs of the spec, or why it refused them.
pub const CONDITION_POD_CIDRS_APPLIED: &str = "PodCIDRsApplied";

/// The taint (effect `NoSchedule`) a Node carries while Rivet is not ready
/// on it: svc-k8s-sync removes it once the node is ready, the operator puts
/// it back when the node's `Ready` condition is not True or its heartbeat
/// went stale.
pub const NOT_READY_TAINT: &str = "node.rivet.io/agent-not-ready";

/// Whether `taint` is Rivet's not-ready taint ([`NOT_READY_TAINT`] with
/// effect `NoSchedule`).
pub fn is_not_ready_taint(taint: &Taint) -> bool {
    taint.key == NOT_READY_TAINT && taint.effect == "NoSchedule"
}

/// One condition, as Kubernetes conditions are written.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeCondition {
    /// The condition, e.g. `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// A CamelCase reason for the last transition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// A human-readable message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the status last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// When the writer last confirmed the condition (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_time: Option<String>,
}

impl RivetNodeStatus {
    /// The condition of type `type_`, if written.
    pub fn condition(&self, type_: &str) -> Option<&NodeCondition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

impl NodeCondition {
    /// `lastHeartbeatTime` read back: `None` when absent, an error when it
    /// is not RFC 3339.
    pub fn last_heartbeat(&self) -> Option<Result<Timestamp, jiff::Error>> {
        self.last_heartbeat_time.as_deref().map(str::parse)
    }
}

/// `at` as Kubernetes writes times (RFC 3339 in UTC, whole seconds:
/// `2026-11-26T06:40:00Z`), for conditions' `lastHeartbeatTime` and
/// `lastTransitionTime`.
///
/// ```
/// use rivet_k8s::k8s_openapi::jiff::Timestamp;
/// let at: Timestamp = "2026-11-26T06:40:00.75Z".parse().unwrap();
/// assert_eq!(rivet_k8s::format_time(at), "2026-11-26T06:40:00Z");
/// ```
pub fn format_time(at: Timestamp) -> String {
    jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", at).expect("a Timestamp formats with a fixed UTC pattern")
}
