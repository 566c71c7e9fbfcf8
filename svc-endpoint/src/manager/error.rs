//! Why manager calls and regenerations fail, and the gRPC status each becomes.

use std::net::IpAddr;
use std::time::Duration;

use tonic::{Code, Status};

use super::EndpointSelector;
use super::PolicySources;
use super::queue::RemovalReason;
use crate::endpoint::{MAX_ENDPOINT_ID, RegenerationStep};
use rivet_policy::{PolicyError, PolicyOrigin};

/// A failed regeneration: the step and the dependency's status.
#[derive(Debug, Clone, thiserror::Error)]
#[error("step {}: {}", step.as_str(), status.message())]
pub struct RegenError {
    /// Where it failed.
    pub step: RegenerationStep,
    /// What the dependency (or the local step) said.
    pub status: Status,
    /// What svc-endpoint makes of it (never read from the status's code:
    /// a dependency's ABORTED or NOT_FOUND means something else).
    pub(crate) kind: FailureKind,
}

/// What a failed regeneration means to svc-endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// A dependency or a local step failed; retried.
    Failed,
    /// svc-loader says the endpoint's host interface is gone, or another
    /// interface is at its ifindex: its pod went without a DEL.
    InterfaceLost(RemovalReason),
    /// Stopped (or a wait ended) because the endpoint is being removed.
    EndpointRemoved,
}

impl RegenError {
    pub(crate) fn new(step: RegenerationStep, status: Status) -> Self {
        Self {
            step,
            status,
            kind: FailureKind::Failed,
        }
    }

    /// The datapath step failed because the endpoint's host interface is
    /// gone or replaced (`reason`).
    pub(crate) fn interface_lost(status: Status, reason: RemovalReason) -> Self {
        Self {
            kind: FailureKind::InterfaceLost(reason),
            ..Self::new(RegenerationStep::Datapath, status)
        }
    }

    /// A regeneration stopped at `step` (or a wait for one ended) because
    /// its endpoint is being removed (ABORTED).
    pub(crate) fn aborted(step: RegenerationStep) -> Self {
        Self {
            kind: FailureKind::EndpointRemoved,
            ..Self::new(step, Status::aborted("endpoint removed"))
        }
    }
}

/// Why a manager call failed.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// A field is invalid.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: String,
        /// Why.
        reason: String,
    },
    /// Nothing matches the reference.
    #[error("no endpoint matches {selector:?}")]
    NotFound {
        /// The reference.
        selector: EndpointSelector,
    },
    /// An address belongs to another endpoint.
    #[error("address {address} is owned by endpoint {owner}")]
    AddressInUse {
        /// The address.
        address: IpAddr,
        /// The endpoint holding it.
        owner: u16,
    },
    /// The container interface is an endpoint with other parameters.
    #[error(
        "container {container_id} interface {interface} is endpoint {existing} with different parameters; delete it first"
    )]
    Conflict {
        /// The container.
        container_id: String,
        /// Its interface.
        interface: String,
        /// The endpoint it is.
        existing: u16,
    },
    /// The container interface's endpoint is being deleted.
    #[error("endpoint {id} of container {container_id} is being deleted; retry")]
    BeingDeleted {
        /// The endpoint.
        id: u16,
        /// Its container.
        container_id: String,
    },
    /// A pod reference matches several endpoints.
    #[error("{} endpoints match ({ids:?}); use the id", ids.len())]
    Ambiguous {
        /// The endpoints it matches.
        ids: Vec<u16>,
    },
    /// Every endpoint id is taken.
    #[error("no free endpoint id (1..={MAX_ENDPOINT_ID} all in use)")]
    NoFreeId,
    /// A regeneration failed; for a synchronous create everything was undone.
    #[error("endpoint {id}: regeneration failed at {}: {}{}", source.step.as_str(), source.status.message(), if *undone { " (undone)" } else { "" })]
    Regeneration {
        /// The endpoint.
        id: u16,
        /// Whether everything done for it was removed.
        undone: bool,
        /// The failure.
        source: RegenError,
    },
    /// A synchronous create found no identity for a new label set: svc-identity
    /// stayed unavailable (its kvstore unreachable) for the whole deadline.
    #[error("endpoint {id}: no identity for its label set within the deadline ({attempts} attempts over {waited:?}; svc-identity needs the kvstore for a label set it has not seen): {}{}", source.status.message(), if *undone { " (undone)" } else { "" })]
    IdentityUnavailable {
        /// The endpoint.
        id: u16,
        /// Allocation attempts made.
        attempts: u32,
        /// Time spent.
        waited: Duration,
        /// Whether everything done for it was removed.
        undone: bool,
        /// svc-identity's last answer.
        source: RegenError,
    },
    /// The deadline passed before the regeneration completed.
    #[error("endpoint {id}: regeneration did not complete within the deadline{}", if *undone { " (undone)" } else { "; it continues" })]
    Deadline {
        /// The endpoint.
        id: u16,
        /// Whether the endpoint is being undone.
        undone: bool,
    },
    /// Removing an endpoint failed (or did not finish within the call's
    /// deadline); it stays `disconnecting`, svc-endpoint keeps retrying in
    /// the background (and then releases its addresses, which the caller
    /// keeps), and the call can be repeated.
    #[error("endpoint {id}: removal failed at {step}: {}; retrying in the background", status.message())]
    Removal {
        /// The endpoint.
        id: u16,
        /// What was being removed.
        step: &'static str,
        /// Why.
        status: Status,
    },
    /// A policy was rejected.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A local state file could not be read or written.
    #[error("{action}: {source}")]
    Storage {
        /// What was being done (`persisting namespace labels`).
        action: String,
        /// Why.
        source: rivet_common::state_file::StateFileError,
    },
    /// The blocking task writing a state file failed.
    #[error("{action}: the blocking task failed: {source}")]
    StorageTask {
        /// What was being done.
        action: String,
        /// Its failure.
        source: tokio::task::JoinError,
    },
    /// Restore has not read the ids held by the datapath or old state dirs
    /// yet (svc-loader not reachable); retrying later can succeed.
    #[error("svc-endpoint is still restoring (svc-loader not reachable yet); retry")]
    Restoring,
    /// svc-identity has not delivered its identities yet; retrying later
    /// can succeed.
    #[error("svc-identity has not delivered its identities yet (is it running?); retry")]
    IdentitiesNotSynced,
    /// A policy of an origin this node does not accept.
    #[error("policies of origin {origin} are not accepted on this node (--policy-sources {sources})")]
    PolicyOriginDisabled {
        /// The policy's origin.
        origin: PolicyOrigin,
        /// The accepted ones.
        sources: PolicySources,
    },
    /// Pod metadata on a node not in Kubernetes mode.
    #[error(
        "this node is not in Kubernetes mode (svc-endpoint runs without --k8s-sync-socket): pod labels come with the CNI call"
    )]
    KubernetesModeOff,
    /// Pod labels set through the API in Kubernetes mode.
    #[error(
        "pod labels come from Kubernetes on this node (svc-endpoint runs with --k8s-sync-socket); label the Pod object instead"
    )]
    LabelsFromKubernetes,
}

impl From<ManagerError> for Status {
    fn from(e: ManagerError) -> Self {
        use rivet_proto::endpoint::v1::ErrorReason as R;
        let message = e.to_string();
        let (code, reason) = match &e {
            ManagerError::Invalid { .. } => return Status::invalid_argument(message),
            ManagerError::NotFound { .. } => (Code::NotFound, R::EndpointNotFound),
            ManagerError::AddressInUse { .. } => (Code::AlreadyExists, R::AddressInUse),
            ManagerError::Conflict { .. } => (Code::FailedPrecondition, R::EndpointConflict),
            ManagerError::BeingDeleted { .. } => (Code::FailedPrecondition, R::EndpointRemoved),
            ManagerError::Ambiguous { .. } => (Code::FailedPrecondition, R::AmbiguousReference),
            ManagerError::NoFreeId => (Code::ResourceExhausted, R::EndpointIdsExhausted),
            ManagerError::Regeneration { source, .. } => match source.status.code() {
                // Keep the dependency's code when it means something to the caller.
                code @ (Code::Unavailable
                | Code::DeadlineExceeded
                | Code::ResourceExhausted
                | Code::NotFound
                | Code::AlreadyExists
                | Code::FailedPrecondition
                | Code::PermissionDenied
                | Code::InvalidArgument) => (code, R::RegenerationFailed),
                _ => (Code::Internal, R::RegenerationFailed),
            },
            ManagerError::IdentityUnavailable { .. } => (Code::Unavailable, R::IdentityUnavailable),
            ManagerError::Deadline { .. } => (Code::DeadlineExceeded, R::NotRealisedInTime),
            ManagerError::Removal { .. } => (Code::Unavailable, R::RemovalPending),
            ManagerError::Policy(PolicyError::OriginConflict { .. }) => {
                (Code::FailedPrecondition, R::PolicyOriginConflict)
            }
            ManagerError::Policy(_) => (Code::InvalidArgument, R::PolicyInvalid),
            ManagerError::Storage { .. } | ManagerError::StorageTask { .. } => return Status::internal(message),
            ManagerError::Restoring | ManagerError::IdentitiesNotSynced => (Code::Unavailable, R::NotReady),
            ManagerError::PolicyOriginDisabled { .. } => (Code::FailedPrecondition, R::PolicyOriginDisabled),
            ManagerError::KubernetesModeOff => (Code::FailedPrecondition, R::KubernetesModeOff),
            ManagerError::LabelsFromKubernetes => (Code::FailedPrecondition, R::LabelsFromKubernetes),
        };
        rivet_common::grpc::status_with_reason(code, message, reason)
    }
}

#[cfg(test)]
mod tests {
    use rivet_proto::endpoint::v1::ErrorReason as R;

    use super::*;

    /// What a client acts on arrives as the reason, with the documented code.
    #[test]
    fn errors_become_statuses_with_their_reason() {
        let cases = [
            (
                ManagerError::NotFound {
                    selector: EndpointSelector::Id(7),
                },
                Code::NotFound,
                Some(R::EndpointNotFound),
            ),
            (
                ManagerError::Conflict {
                    container_id: "c".into(),
                    interface: "eth0".into(),
                    existing: 3,
                },
                Code::FailedPrecondition,
                Some(R::EndpointConflict),
            ),
            (
                ManagerError::BeingDeleted {
                    id: 3,
                    container_id: "c".into(),
                },
                Code::FailedPrecondition,
                Some(R::EndpointRemoved),
            ),
            (
                ManagerError::Ambiguous { ids: vec![1, 2] },
                Code::FailedPrecondition,
                Some(R::AmbiguousReference),
            ),
            (ManagerError::Restoring, Code::Unavailable, Some(R::NotReady)),
            (
                ManagerError::PolicyOriginDisabled {
                    origin: PolicyOrigin::Kubernetes,
                    sources: PolicySources::default_for(false),
                },
                Code::FailedPrecondition,
                Some(R::PolicyOriginDisabled),
            ),
            (
                ManagerError::KubernetesModeOff,
                Code::FailedPrecondition,
                Some(R::KubernetesModeOff),
            ),
            (
                ManagerError::LabelsFromKubernetes,
                Code::FailedPrecondition,
                Some(R::LabelsFromKubernetes),
            ),
            (ManagerError::IdentitiesNotSynced, Code::Unavailable, Some(R::NotReady)),
            (
                ManagerError::NoFreeId,
                Code::ResourceExhausted,
                Some(R::EndpointIdsExhausted),
            ),
            (
                ManagerError::Deadline { id: 1, undone: false },
                Code::DeadlineExceeded,
                Some(R::NotRealisedInTime),
            ),
            (
                ManagerError::Invalid {
                    field: "pod_name".into(),
                    reason: "bad".into(),
                },
                Code::InvalidArgument,
                None,
            ),
        ];
        for (error, code, reason) in cases {
            let text = error.to_string();
            let status = Status::from(error);
            assert_eq!(status.code(), code, "{text}");
            assert_eq!(rivet_common::grpc::error_reason::<R>(&status), reason, "{text}");
            assert_eq!(status.message(), text);
        }
    }
}
