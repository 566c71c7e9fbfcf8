//! Rivet's Kubernetes pieces, shared by svc-k8s-sync, svc-identity's
//! `kubernetes` store and the tests:
//!
//! - the custom resources of API group `rivet.io` (version `v1`), as Rust
//!   types with kube's `CustomResource` derive: [`RivetNetworkPolicy`],
//!   [`RivetEndpoint`], [`RivetNode`], [`RivetIdentity`]; their
//!   CustomResourceDefinitions ([`crds`]) are generated into `deploy/crds/`
//!   by `cargo xtask crds`;
//! - building a kube client from a kubeconfig or the in-cluster
//!   ServiceAccount ([`ClusterAccess`]); API errors' status and metric
//!   label ([`status_code`], [`error_kind`]);
//! - turning a policy object read from the API into a `rivet_policy::Policy`
//!   ([`policy_from_object`]);
//! - a RivetNode as a node record of the cluster ([`records`]).
//!
//! Not here: watching, reconciling and writing (svc-k8s-sync), identity
//! allocation (svc-identity).

mod client;
mod crd;
mod policy;
pub mod records;

pub use client::{ClientError, ClusterAccess, error_kind, status_code};
pub use crd::endpoint::{RivetEndpoint, RivetEndpointSpec, RivetEndpointState, RivetEndpointStatus};
pub use crd::identity::{RivetIdentity, RivetIdentitySpec};
pub use crd::network_policy::{
    DefaultDeny, EgressRule, IngressRule, IpBlock, PolicyPeer, PolicyPort, RivetNetworkPolicy, RivetNetworkPolicySpec,
};
pub use crd::node::{
    CONDITION_POD_CIDRS_ALLOCATED, CONDITION_POD_CIDRS_APPLIED, CONDITION_READY, Encapsulation, EncapsulationMode,
    NOT_READY_TAINT, NodeAddress, NodeCondition, RivetNode, RivetNodeSpec, RivetNodeStatus, format_time,
    is_not_ready_taint,
};
pub use crd::{API_GROUP, API_VERSION, CRD_KUSTOMIZATION, CrdManifest, crd_kustomization, crd_manifests, crds};
pub use policy::policy_from_object;

/// Re-exported so users name one kube and one k8s-openapi.
pub use k8s_openapi;
pub use kube;
