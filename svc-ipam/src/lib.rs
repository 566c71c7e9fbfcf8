//! svc-ipam: per-node address pools served over gRPC on a Unix socket.
//!
//! - [`pool`]: pool configuration (`--pool NAME=CIDR[,CIDR...]`), validated
//!   at start (size, alignment, overlap);
//! - [`allocator`]: the allocation rules, pure and in memory;
//! - [`store`]: the allocator made durable (group-committed state file);
//! - [`service`]: the `rivet.ipam.v1.Ipam` gRPC service;
//! - [`events`]: logs and metrics, emitted together.

pub mod allocator;
pub mod events;
pub mod pool;
pub mod service;
pub mod store;

/// The daemon's name: its socket is `<socket-dir>/svc-ipam.sock`.
pub const DAEMON_NAME: &str = "svc-ipam";

/// Capabilities svc-ipam keeps: none (it only reads and writes its state dir
/// and serves its socket).
pub const CAPABILITIES: &[rivet_common::privileges::Capability] = &[];

/// Methods that only read: members of the operator group may call them.
pub const READ_ONLY_METHODS: rivet_common::access::ReadOnlyMethods =
    &[(rivet_proto::ipam::v1::ipam_server::SERVICE_NAME, &["List"])];

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
