//! `RivetNetworkPolicy`: Kubernetes NetworkPolicy plus entities, deny rules,
//! ICMP/ICMPv6/ANY protocols and `enableDefaultDeny`. The spec is the one
//! rivet-policy accepts for kind RivetNetworkPolicy; rivet-policy validates
//! it ([`crate::policy_from_object`]), so the schema here stays permissive
//! where the parser gives the better error (protocol names, entities,
//! operators).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The spec of a `RivetNetworkPolicy` (`rivet.io/v1`), namespaced; short name `rnp`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "rivet.io",
    version = "v1",
    kind = "RivetNetworkPolicy",
    namespaced,
    shortname = "rnp",
    category = "rivet",
    derive = "PartialEq",
    doc = "A Rivet network policy: a Kubernetes NetworkPolicy with entities, deny rules, ICMP and enableDefaultDeny.",
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct RivetNetworkPolicySpec {
    /// The pods of the policy's namespace it applies to; `{}` selects all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// `Ingress`, `Egress` or both; defaulted from the rules as for a NetworkPolicy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_types: Option<Vec<String>>,
    /// Allowed incoming traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<Vec<IngressRule>>,
    /// Allowed outgoing traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<EgressRule>>,
    /// Denied incoming traffic (wins over every allow).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress_deny: Option<Vec<IngressRule>>,
    /// Denied outgoing traffic (wins over every allow).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_deny: Option<Vec<EgressRule>>,
    /// Whether selecting a pod denies by default what is not allowed, per
    /// direction (default true in each direction of policyTypes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_default_deny: Option<DefaultDeny>,
}

/// One ingress rule: traffic from any of `from` to any of `ports`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct IngressRule {
    /// Absent or empty: any peer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Vec<PolicyPeer>>,
    /// Absent or empty: every protocol and port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<PolicyPort>>,
}

/// One egress rule: traffic to any of `to` on any of `ports`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct EgressRule {
    /// Absent or empty: any peer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<Vec<PolicyPeer>>,
    /// Absent or empty: every protocol and port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<PolicyPort>>,
}

/// One peer: pods (by pod and/or namespace selector), an address block, or entities.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyPeer {
    /// Pods with these labels (in the policy's namespace unless `namespaceSelector` is given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// Namespaces with these labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Every address in `cidr` outside each `except`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_block: Option<IpBlock>,
    /// `world`, `host`, `cluster`, `remote-node` or `all`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entities: Option<Vec<String>>,
}

/// An address block.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct IpBlock {
    /// A prefix, e.g. `198.18.0.0/15`.
    pub cidr: String,
    /// Prefixes inside `cidr` that are excluded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub except: Option<Vec<String>>,
}

/// One port (range) of a protocol.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyPort {
    /// `TCP` (default), `UDP`, `SCTP`, `ICMP`, `ICMPv6` or `ANY`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// A port number or a named container port; absent: every port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<IntOrString>,
    /// The last port of a range starting at `port` (numeric ports only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_port: Option<i32>,
}

/// `enableDefaultDeny`, per direction.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct DefaultDeny {
    /// Default deny for incoming traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<bool>,
    /// Default deny for outgoing traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<bool>,
}
