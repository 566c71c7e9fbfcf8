//! svc-endpoint: the unprivileged orchestrator of a node (DESIGN.md §1, §5,
//! §6). It drives svc-identity, svc-ipam and svc-loader over gRPC and owns
//! the node's endpoint state on disk.
//!
//! - the policy engine (NetworkPolicy + Rivet's kind, selector cache,
//!   resolution into datapath entries) is the `rivet-policy` crate;
//! - [`manager`]: endpoints, their state machine and regeneration queues,
//!   restore on start, resync when a dependency restarts (one module per
//!   concern: create, removal, queue, worker, regeneration, restore, ...);
//! - [`state_dir`]: `<state-dir>/endpoints/<id>/`, crash-safe;
//! - [`clients`]: the other daemons behind small traits;
//! - [`catalog`]: the service catalog (Services, EndpointSlices, cluster
//!   IPs, backends, the push to svc-loader's LoadBalancerService);
//! - [`service`]: the `rivet.endpoint.v1` gRPC services but the catalog's,
//!   which [`catalog_api`] serves;
//! - [`policy_dir`]: the watched `--policy-dir`.

pub mod catalog;
pub mod catalog_api;
pub mod clients;
pub mod endpoint;
pub mod events;
pub mod manager;
pub mod policy_dir;
pub mod service;
pub mod state_dir;

/// The daemon's name: its socket is `<socket-dir>/svc-endpoint.sock`.
pub const DAEMON_NAME: &str = "svc-endpoint";

/// Capabilities svc-endpoint keeps: none (it orchestrates over sockets and
/// writes its state dir; the kernel work is svc-loader's).
pub const CAPABILITIES: &[rivet_common::privileges::Capability] = &[];

/// Methods that only read: members of the reader group may call them.
pub const READ_ONLY_METHODS: rivet_common::access::ReadOnlyMethods = &[
    (
        rivet_proto::endpoint::v1::endpoint_service_server::SERVICE_NAME,
        &["GetEndpoint", "ListEndpoints", "GetStatus", "WatchEndpoints"],
    ),
    (
        rivet_proto::endpoint::v1::policy_service_server::SERVICE_NAME,
        &["ListPolicies", "GetPolicy"],
    ),
    (
        rivet_proto::endpoint::v1::namespace_service_server::SERVICE_NAME,
        &["ListNamespaces"],
    ),
    (
        rivet_proto::endpoint::v1::service_catalog_service_server::SERVICE_NAME,
        &["ListServices", "GetService"],
    ),
];

#[cfg(test)]
mod read_only_methods_tests {
    #[test]
    fn read_only_methods_are_rpcs_of_their_services() {
        assert_eq!(
            rivet_common::access::unknown_methods(super::DAEMON_NAME, super::READ_ONLY_METHODS),
            Vec::<String>::new()
        );
    }
}
