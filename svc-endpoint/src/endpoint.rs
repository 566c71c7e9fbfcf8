//! One endpoint: what it was created with ([`EndpointSpec`], persisted in the
//! state dir) and what svc-endpoint knows about it now ([`EndpointStatus`]:
//! state machine, identity, realised policy, last regeneration).

use std::collections::VecDeque;
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use rivet_common::labels::Labels;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::net;
use serde::{Deserialize, Serialize};

use rivet_policy::{NamedPort, Protocol, ResolvedPolicy};

/// Endpoint ids are 1..=65535 (the datapath keys policy by a 16-bit id).
pub const MAX_ENDPOINT_ID: u16 = u16::MAX;

/// How many transitions an endpoint remembers.
pub const HISTORY_LEN: usize = 20;

/// States of DESIGN.md §5.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum EndpointState {
    /// Read from the state dir at start, not regenerated yet.
    Restoring,
    /// Recorded; its identity is being allocated.
    WaitingForIdentity,
    /// A regeneration is queued (or a failed one waits for its retry).
    WaitingToRegenerate,
    /// A regeneration runs.
    Regenerating,
    /// The datapath holds the endpoint's identity and current policy.
    Ready,
    /// Being removed.
    Disconnecting,
    /// Removed; about to be forgotten.
    Disconnected,
}

impl EndpointState {
    /// Every state, in lifecycle order.
    pub const ALL: [EndpointState; 7] = [
        Self::Restoring,
        Self::WaitingForIdentity,
        Self::WaitingToRegenerate,
        Self::Regenerating,
        Self::Ready,
        Self::Disconnecting,
        Self::Disconnected,
    ];

    /// The wire enum.
    pub fn to_proto(self) -> pb::EndpointState {
        match self {
            Self::Restoring => pb::EndpointState::Restoring,
            Self::WaitingForIdentity => pb::EndpointState::WaitingForIdentity,
            Self::WaitingToRegenerate => pb::EndpointState::WaitingToRegenerate,
            Self::Regenerating => pb::EndpointState::Regenerating,
            Self::Ready => pb::EndpointState::Ready,
            Self::Disconnecting => pb::EndpointState::Disconnecting,
            Self::Disconnected => pb::EndpointState::Disconnected,
        }
    }

    /// From the wire enum; `None` for UNSPECIFIED.
    pub fn from_proto(state: pb::EndpointState) -> Option<Self> {
        Some(match state {
            pb::EndpointState::Unspecified => return None,
            pb::EndpointState::Restoring => Self::Restoring,
            pb::EndpointState::WaitingForIdentity => Self::WaitingForIdentity,
            pb::EndpointState::WaitingToRegenerate => Self::WaitingToRegenerate,
            pb::EndpointState::Regenerating => Self::Regenerating,
            pb::EndpointState::Ready => Self::Ready,
            pb::EndpointState::Disconnecting => Self::Disconnecting,
            pb::EndpointState::Disconnected => Self::Disconnected,
        })
    }

    /// Name for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Restoring => "restoring",
            Self::WaitingForIdentity => "waiting-for-identity",
            Self::WaitingToRegenerate => "waiting-to-regenerate",
            Self::Regenerating => "regenerating",
            Self::Ready => "ready",
            Self::Disconnecting => "disconnecting",
            Self::Disconnected => "disconnected",
        }
    }
}

/// A regeneration step, to say where a failure happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegenerationStep {
    /// Allocating the identity (svc-identity).
    Identity,
    /// Computing the policy.
    Policy,
    /// Realising it in the datapath (svc-loader).
    Datapath,
    /// Publishing the addresses in the ipcache (svc-identity).
    Ipcache,
    /// Writing the state dir.
    StateDir,
}

impl RegenerationStep {
    /// The wire enum.
    pub fn to_proto(self) -> pb::RegenerationStep {
        match self {
            Self::Identity => pb::RegenerationStep::Identity,
            Self::Policy => pb::RegenerationStep::Policy,
            Self::Datapath => pb::RegenerationStep::Datapath,
            Self::Ipcache => pb::RegenerationStep::Ipcache,
            Self::StateDir => pb::RegenerationStep::StateDir,
        }
    }

    /// Name for messages and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Identity => "identity",
            Self::Policy => "policy",
            Self::Datapath => "datapath",
            Self::Ipcache => "ipcache",
            Self::StateDir => "state-dir",
        }
    }
}

/// One pod address and the svc-ipam pool it came from (empty when svc-ipam
/// did not allocate it: then it is never reserved or released here).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointAddress {
    /// The address.
    pub address: IpAddr,
    /// svc-ipam pool, or empty.
    pub ipam_pool: String,
}

/// What an endpoint was created with. Persisted in its state dir; never
/// changes except the pod labels ([`EndpointSpec::labels`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointSpec {
    /// 1..=65535, unique on the node.
    pub id: u16,
    /// The container runtime's sandbox id.
    pub container_id: String,
    /// Interface name inside the container.
    pub interface: String,
    /// The container's network namespace path.
    pub netns_path: String,
    /// Host side of the veth pair.
    pub host_interface: String,
    /// Its ifindex in the node's network namespace.
    pub host_ifindex: u32,
    /// At most one per family.
    pub addresses: Vec<EndpointAddress>,
    /// Container-side MAC.
    pub mac: [u8; 6],
    /// Pod namespace (`default` when created outside Kubernetes without one).
    pub pod_namespace: String,
    /// Pod name, may be empty.
    pub pod_name: String,
    /// Pod UID, may be empty.
    pub pod_uid: String,
    /// The pod's own labels.
    pub labels: Labels,
    /// Named container ports.
    pub named_ports: Vec<NamedPort>,
    /// When it was created.
    pub created: SystemTime,
    /// Kubernetes mode: the pod's labels are not known yet; the endpoint
    /// holds the reserved `init` identity until they arrive.
    #[serde(default)]
    pub labels_pending: bool,
    /// A pod, or the node's health endpoint (state dirs written before
    /// there was a kind are pods').
    #[serde(default)]
    pub kind: EndpointKind,
}

/// What an endpoint is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointKind {
    /// A pod.
    #[default]
    Pod,
    /// The node's health endpoint (svc-health's): the reserved `health`
    /// identity whatever its labels. Created by root only (rivet-cni run by
    /// `rivet node up`).
    Health,
}

impl EndpointKind {
    /// On the wire.
    pub fn to_proto(self) -> pb::EndpointKind {
        match self {
            Self::Pod => pb::EndpointKind::Pod,
            Self::Health => pb::EndpointKind::Health,
        }
    }
}

impl EndpointSpec {
    /// The owner name of this endpoint's references in svc-identity.
    pub fn identity_owner(&self) -> String {
        identity_owner(self.id)
    }

    /// Whether another spec describes the same interface with the same
    /// parameters (an idempotent repeat of a create).
    pub fn same_request(&self, other: &EndpointSpec) -> bool {
        self.container_id == other.container_id
            && self.interface == other.interface
            && self.netns_path == other.netns_path
            && self.host_interface == other.host_interface
            && self.host_ifindex == other.host_ifindex
            && self.addresses == other.addresses
            && self.mac == other.mac
            && self.pod_namespace == other.pod_namespace
            && self.pod_name == other.pod_name
            && self.kind == other.kind
    }

    /// Whether it is the pod `namespace/name`.
    pub fn is_pod(&self, namespace: &str, name: &str) -> bool {
        !self.pod_name.is_empty() && self.pod_namespace == namespace && self.pod_name == name
    }

    /// Whether one of its addresses is `address`.
    pub fn has_address(&self, address: IpAddr) -> bool {
        self.addresses.iter().any(|a| a.address == address)
    }
}

/// The owner name of endpoint `id`'s references in svc-identity.
pub fn identity_owner(id: u16) -> String {
    format!("{IDENTITY_OWNER_PREFIX}{id}")
}

/// Prefix of every identity owner svc-endpoint uses for endpoints.
pub const IDENTITY_OWNER_PREFIX: &str = "endpoint/";

/// One state change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// Before.
    pub from: EndpointState,
    /// After.
    pub to: EndpointState,
    /// Why.
    pub reason: String,
    /// When.
    pub at: SystemTime,
}

/// A failed regeneration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegenerationFailure {
    /// Where.
    pub step: RegenerationStep,
    /// What went wrong.
    pub message: String,
    /// When.
    pub at: SystemTime,
}

/// What svc-endpoint knows about an endpoint now.
#[derive(Debug, Clone)]
pub struct EndpointStatus {
    /// Current state.
    pub state: EndpointState,
    /// 0 until allocated.
    pub identity: u32,
    /// The identity's labels (pod + namespace labels, filtered).
    pub identity_labels: Labels,
    /// The policy the datapath holds for the endpoint.
    pub realised_policy: Option<ResolvedPolicy>,
    /// Repository revision of [`realised_policy`](Self::realised_policy).
    pub policy_revision: u64,
    /// Last successful regeneration.
    pub last_regeneration: Option<(SystemTime, Duration)>,
    /// Successful regenerations.
    pub regenerations: u64,
    /// The last attempt's failure, cleared by a success.
    pub last_error: Option<RegenerationFailure>,
    /// Recent transitions, oldest first.
    pub history: VecDeque<Transition>,
    /// W3C `traceparent` of the request that created the endpoint or last
    /// changed its labels; empty when untraced (and after a restore).
    pub traceparent: String,
}

impl EndpointStatus {
    /// A status in `state`.
    pub fn new(state: EndpointState, reason: &str) -> Self {
        let mut status = Self {
            state,
            identity: 0,
            identity_labels: Labels::new(),
            realised_policy: None,
            policy_revision: 0,
            last_regeneration: None,
            regenerations: 0,
            last_error: None,
            history: VecDeque::with_capacity(HISTORY_LEN),
            traceparent: String::new(),
        };
        status.history.push_back(Transition {
            from: state,
            to: state,
            reason: reason.to_string(),
            at: SystemTime::now(),
        });
        status
    }

    /// Moves to `to`, remembering why. Returns the previous state.
    pub fn transition(&mut self, id: u16, to: EndpointState, reason: &str) -> EndpointState {
        let from = self.state;
        if from == to {
            return from;
        }
        tracing::debug!(
            endpoint = id,
            from = from.as_str(),
            to = to.as_str(),
            reason,
            "endpoint state changed"
        );
        self.state = to;
        if self.history.len() == HISTORY_LEN {
            self.history.pop_front();
        }
        self.history.push_back(Transition {
            from,
            to,
            reason: reason.to_string(),
            at: SystemTime::now(),
        });
        from
    }
}

/// Nanoseconds since the Unix epoch (0 before it).
pub fn unix_nanos(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The wire form of an endpoint.
pub fn to_proto(spec: &EndpointSpec, status: &EndpointStatus, include_history: bool) -> pb::Endpoint {
    let policy = status.realised_policy.as_ref();
    pb::Endpoint {
        id: u32::from(spec.id),
        container_id: spec.container_id.clone(),
        interface: spec.interface.clone(),
        netns_path: spec.netns_path.clone(),
        host_interface: spec.host_interface.clone(),
        host_ifindex: spec.host_ifindex,
        addresses: spec
            .addresses
            .iter()
            .map(|a| pb::EndpointAddress {
                address: net::address_bytes(a.address),
                ipam_pool: a.ipam_pool.clone(),
            })
            .collect(),
        mac: spec.mac.to_vec(),
        pod_namespace: spec.pod_namespace.clone(),
        pod_name: spec.pod_name.clone(),
        pod_uid: spec.pod_uid.clone(),
        labels: spec.labels.iter().map(ToString::to_string).collect(),
        kind: spec.kind.to_proto().into(),
        traceparent: status.traceparent.clone(),
        identity_labels: status.identity_labels.iter().map(ToString::to_string).collect(),
        identity: status.identity,
        state: status.state.to_proto().into(),
        policy_revision: status.policy_revision,
        ingress_enforced: policy.is_some_and(|p| p.enforce_ingress),
        egress_enforced: policy.is_some_and(|p| p.enforce_egress),
        policy_entries: policy.map_or(0, |p| u32::try_from(p.entries.len()).unwrap_or(u32::MAX)),
        created_unix_nanos: unix_nanos(spec.created),
        last_regeneration_unix_nanos: status.last_regeneration.map_or(0, |(at, _)| unix_nanos(at)),
        last_regeneration_nanos: status
            .last_regeneration
            .map_or(0, |(_, took)| u64::try_from(took.as_nanos()).unwrap_or(u64::MAX)),
        regenerations: status.regenerations,
        last_error: status
            .last_error
            .as_ref()
            .map(|e| e.message.clone())
            .unwrap_or_default(),
        last_error_step: status
            .last_error
            .as_ref()
            .map_or(pb::RegenerationStep::Unspecified, |e| e.step.to_proto())
            .into(),
        last_error_unix_nanos: status.last_error.as_ref().map_or(0, |e| unix_nanos(e.at)),
        state_history: if include_history {
            status
                .history
                .iter()
                .map(|t| pb::StateTransition {
                    from: t.from.to_proto().into(),
                    to: t.to.to_proto().into(),
                    reason: t.reason.clone(),
                    at_unix_nanos: unix_nanos(t.at),
                })
                .collect()
        } else {
            Vec::new()
        },
        named_ports: spec
            .named_ports
            .iter()
            .map(|p| pb::NamedPort {
                name: p.name.clone(),
                protocol: protocol_name(p.protocol).to_string(),
                port: u32::from(p.port),
            })
            .collect(),
        labels_pending: spec.labels_pending,
    }
}

/// Kubernetes' spelling of a container port protocol.
pub fn protocol_name(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
        Protocol::Sctp => "SCTP",
        Protocol::Icmp => "ICMP",
        Protocol::Icmpv6 => "ICMPv6",
        Protocol::Any => "ANY",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_is_bounded_and_keeps_the_newest() {
        let mut status = EndpointStatus::new(EndpointState::WaitingForIdentity, "created");
        for i in 0..(HISTORY_LEN * 2) {
            let to = if i % 2 == 0 {
                EndpointState::Regenerating
            } else {
                EndpointState::Ready
            };
            status.transition(1, to, &format!("step {i}"));
        }
        assert_eq!(status.history.len(), HISTORY_LEN, "history must stay bounded");
        assert_eq!(
            status.history.back().map(|t| t.reason.as_str()),
            Some(format!("step {}", HISTORY_LEN * 2 - 1).as_str()),
            "the newest transition must be kept"
        );
    }
}
