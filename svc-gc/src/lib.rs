//! svc-gc: conntrack and service translation garbage collection as its own
//! daemon, so its CPU and privileges are its own and it restarts alone. It
//! opens the node's pinned `ct4`, `ct6`, `lb4_flows`, `lb6_flows` and
//! `lb_affinity` maps (and reads `lb_frontends`) by path, read-write, and
//! needs no other BPF object.
//!
//! - [`classify`]: which entries go and why (expired per protocol and TCP
//!   state against the kernel's monotonic clock; orphaned endpoints);
//! - [`pass`]: one pass — chunked batch reads, a re-check of every entry
//!   before its delete (a refreshed entry survives), batch deletes;
//! - [`map`]: map access behind [`map::EntryMap`]: raw `bpf(2)` batch commands
//!   with a per-element fallback, fill estimates;
//! - [`interval`]: the adaptive interval rule;
//! - [`collector`]: the loop (initial pass, interval, RunNow, map pressure);
//! - [`endpoints`]: the node's endpoints from svc-endpoint;
//! - [`clock`]: the kernel's monotonic clock;
//! - [`service`]: `rivet.gc.v1.GcService`; [`events`]: logs and metrics;
//! - [`sys`]: the raw `bpf(2)` commands aya 0.14 lacks.

pub mod classify;
pub mod clock;
pub mod collector;
pub mod endpoints;
pub mod events;
pub mod interval;
pub mod map;
pub mod pass;
pub mod service;
pub use rivet_bpf_sys as sys;

/// The daemon's name: its socket is `<socket-dir>/svc-gc.sock`.
pub const DAEMON_NAME: &str = "svc-gc";

/// Capabilities svc-gc keeps: none, measured on kernel 6.18 (the README's
/// "Privileges" table says why). Opening a pinned map is a file permission
/// check on the pin, and lookups, batch reads and deletes on an open map fd
/// need no capability: svc-gc runs as the user that owns svc-loader's pins.
pub const CAPABILITIES: &[rivet_common::privileges::Capability] = &[];

/// Methods that only read: members of the reader group may call them.
pub const READ_ONLY_METHODS: rivet_common::access::ReadOnlyMethods =
    &[(rivet_proto::gc::v1::gc_service_server::SERVICE_NAME, &["Status"])];

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
