//! `RivetEndpoint`: one per pod, in the pod's namespace and with the pod's
//! name, owned by the pod (deleted with it). svc-k8s-sync writes its status
//! (server-side apply) from svc-endpoint's endpoint; the spec is empty. Like
//! Cilium's CiliumEndpoint: `kubectl get rivetendpoints` shows each pod's
//! endpoint id, identity, state and addresses.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The (empty) spec of a `RivetEndpoint` (`rivet.io/v1`), namespaced; short
/// name `rep`. Everything is in the status.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "rivet.io",
    version = "v1",
    kind = "RivetEndpoint",
    namespaced,
    shortname = "rep",
    category = "rivet",
    status = "RivetEndpointStatus",
    derive = "PartialEq",
    doc = "A pod's Rivet endpoint as realised on its node: endpoint id, identity, addresses, state, policy revision.",
    printcolumn(name = "ID", type_ = "integer", json_path = ".status.id"),
    printcolumn(name = "Identity", type_ = "integer", json_path = ".status.identity"),
    printcolumn(name = "State", type_ = "string", json_path = ".status.state"),
    printcolumn(name = "IPv4", type_ = "string", json_path = ".status.ipv4"),
    printcolumn(name = "IPv6", type_ = "string", json_path = ".status.ipv6"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.node"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
pub struct RivetEndpointSpec {}

/// The endpoint as svc-endpoint has it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RivetEndpointStatus {
    /// The endpoint id, unique on its node (1..65535).
    pub id: u32,
    /// The node the endpoint lives on.
    pub node: String,
    /// The container (sandbox) id the endpoint was created for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// The security identity; absent until allocated (5, `init`, while the
    /// pod's labels are not known yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<u32>,
    /// The labels the identity stands for, `source:key=value`, sorted.
    #[serde(default)]
    pub identity_labels: Vec<String>,
    /// The pod's IPv4 address, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<String>,
    /// The pod's IPv6 address, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<String>,
    /// Where the endpoint is in its life.
    pub state: RivetEndpointState,
    /// The policy repository revision realised in the datapath for it.
    #[serde(default)]
    pub policy_revision: u64,
    /// Whether some policy selects it for ingress (ingress is enforced).
    #[serde(default)]
    pub ingress_enforced: bool,
    /// Whether some policy selects it for egress (egress is enforced).
    #[serde(default)]
    pub egress_enforced: bool,
    /// The last regeneration failure; absent when the last attempt succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// The endpoint's state (svc-endpoint's `EndpointState`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RivetEndpointState {
    /// Read from the state dir at start, not yet regenerated.
    Restoring,
    /// Waiting for its identity.
    #[default]
    WaitingForIdentity,
    /// Queued for regeneration.
    WaitingToRegenerate,
    /// Being regenerated.
    Regenerating,
    /// Realised in the datapath.
    Ready,
    /// Being removed.
    Disconnecting,
    /// Removed.
    Disconnected,
}
