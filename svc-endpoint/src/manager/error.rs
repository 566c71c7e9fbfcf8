//! Why manager calls and regenerations fail, and the gRPC status each becomes.

use std::net::IpAddr;
use std::time::Duration;

use tonic::{Code, Status};

use super::queue::RemovalReason;
use crate::endpoint::{MAX_ENDPOINT_ID, RegenerationStep};
use rivet_policy::PolicyError;

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
    #[error("{0}")]
    NotFound(String),
    /// An address belongs to another endpoint.
    #[error("address {address} is owned by endpoint {owner}")]
    AddressInUse {
        /// The address.
        address: IpAddr,
        /// The endpoint holding it.
        owner: u16,
    },
    /// The state does not allow the call.
    #[error("{0}")]
    Precondition(String),
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
    /// A local file could not be written.
    #[error("{0}")]
    Storage(String),
    /// A dependency is not ready; retrying later can succeed.
    #[error("{0}")]
    Unavailable(String),
}

impl From<ManagerError> for Status {
    fn from(e: ManagerError) -> Self {
        use rivet_proto::endpoint::v1::ErrorReason as R;
        let message = e.to_string();
        let (code, reason) = match &e {
            ManagerError::Invalid { .. } => return Status::invalid_argument(message),
            ManagerError::NotFound(_) => (Code::NotFound, R::EndpointNotFound),
            ManagerError::AddressInUse { .. } => (Code::AlreadyExists, R::AddressInUse),
            ManagerError::Precondition(_) => return Status::failed_precondition(message),
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
            ManagerError::Storage(_) => return Status::internal(message),
            ManagerError::Unavailable(_) => (Code::Unavailable, R::NotReady),
        };
        rivet_common::grpc::status_with_reason(code, message, reason)
    }
}
