//! svc-health: connectivity between nodes (the seed's cilium-health). Every
//! probe interval it probes each peer node the node registry lists (ICMP echo
//! and HTTP `/hello` on port 4240 of its underlay addresses, HTTP `/hello` of
//! its health endpoint through the pod datapath), serves `/hello` on this
//! node's underlay addresses for the peers' probes, and reports the matrix
//! (`rivet.health.v1.HealthService`, `rivet health`, `rivet status`,
//! `rivet_health_*` metrics). It runs in the node's network namespace with
//! no capability (see the README's "Privileges").
//!
//! - [`probe`]: targets and outcomes (pure);
//! - [`table`]: the results across rounds and the state changes (pure);
//! - [`net`]: the probes on the wire and the `/hello` server;
//! - [`helper`]: sockets of the health endpoint's namespace for the daemon;
//! - [`peers`]: the peers from svc-identity's `NodeService`;
//! - [`prober`]: the rounds; [`service`]: the gRPC API; [`events`]: logs
//!   and metrics.

pub mod events;
pub mod helper;
pub mod net;
pub mod peers;
pub mod probe;
pub mod prober;
pub mod service;
pub mod table;

/// The daemon's name: its socket is `<socket-dir>/svc-health.sock`.
pub const DAEMON_NAME: &str = "svc-health";

/// Capabilities svc-health keeps: none. ICMP echo uses unprivileged ICMP
/// sockets (allowed by the node namespace's `net.ipv4.ping_group_range`,
/// which `rivet node up` sets there), HTTP probes are plain TCP and port
/// 4240 is not a privileged port.
pub const CAPABILITIES: &[rivet_common::privileges::Capability] = &[];

/// Methods that only read: members of the reader group may call them.
pub const READ_ONLY_METHODS: rivet_common::access::ReadOnlyMethods = &[(
    rivet_proto::health::v1::health_service_server::SERVICE_NAME,
    &["GetHealth"],
)];

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
