//! svc-ipam: per-node address pools served over gRPC on a Unix socket.
//!
//! - [`pool`]: pool configuration (`--pool NAME=CIDR[,CIDR...]`, fixed, or
//!   SetPool, replaceable), validated together (size, alignment, overlap);
//! - [`allocator`]: the allocation rules, pure and in memory;
//! - [`store`]: the allocator made durable (group-committed state file);
//! - [`service`]: the `rivet.ipam.v1.Ipam` gRPC service;
//! - [`events`]: logs and metrics, emitted together.

pub mod allocator;
pub mod events;
pub mod pool;
pub mod service;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use rivet_common::controller::{Action, Controller, Controllers};

/// The daemon's name: its socket is `<socket-dir>/svc-ipam.sock`.
pub const DAEMON_NAME: &str = "svc-ipam";

/// Capabilities svc-ipam keeps: none (it only reads and writes its state dir
/// and serves its socket).
pub const CAPABILITIES: &[rivet_common::privileges::Capability] = &[];

/// Methods that only read: members of the reader group may call them.
pub const READ_ONLY_METHODS: rivet_common::access::ReadOnlyMethods =
    &[(rivet_proto::ipam::v1::ipam_server::SERVICE_NAME, &["List"])];

/// Runs controller `pool`, which fails while svc-ipam has no pool at all
/// (cluster-pool IPAM before svc-k8s-sync's first SetPool): the daemon is
/// degraded in GetInfo from the start ("no pool yet: waiting for the
/// node's pod CIDRs"), so svc-k8s-sync does not mark the node ready before
/// it can hand out addresses. Done once a pool exists (pools are never
/// removed).
pub fn report_missing_pool(controllers: &Controllers, store: Arc<store::IpamStore>) {
    let controller = Controller::new("pool")
        .degraded_after(Duration::ZERO)
        .trigger(store.pool_changed());
    controllers.reconcile(controller, move || {
        let store = store.clone();
        async move {
            match store.pools().is_empty() {
                true => Err(allocator::AllocError::NoPoolYet),
                false => Ok(Action::done()),
            }
        }
    });
}

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
