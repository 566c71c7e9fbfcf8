//! svc-identity: label sets → cluster-wide security identities in etcd (or
//! the embedded store on a single node), reserved identities, and the IP
//! cache (IP → identity) published to the store and pushed to svc-loader.
//!
//! - [`backend`]: the store trait and its key layout;
//! - [`etcd_backend`]: the store in etcd (a cluster), with the node lease;
//! - [`embedded_backend`]: the store in one crash-safe local file (one node);
//! - [`kubernetes_backend`]: the store as `RivetIdentity` objects in the
//!   Kubernetes API (CRD mode);
//! - [`kubernetes_cluster`]: the other nodes (RivetNodes) and their pods
//!   (RivetEndpoints) from the API, for the registry and the IP cache in
//!   CRD mode;
//! - [`allocator`]: allocation, local references, the identity cache and the
//!   reconcile loop that keeps this node's value keys in the store;
//! - [`ipcache`]: the IP cache, its publication to the store and the push to
//!   svc-loader;
//! - `reconcile`: when the reconcile passes of both run (woken, periodic,
//!   retried with backoff);
//! - [`snapshot`]: the local snapshot served while etcd is unreachable
//!   (also right after a restart during an outage);
//! - [`events`]: log lines and metrics of the outage events;
//! - [`heartbeat`]: the watchdog of rivet-operator's kvstore heartbeat
//!   (reported, never acted on);
//! - [`registry`]: the node registry (this node's record in the store, the
//!   other nodes' from it, their addresses as remote-node, the peers for
//!   svc-loader) and [`node_service`], its `NodeService`;
//! - `store_watch`: the list-then-watch loop of the store's followers;
//! - [`service`]: the `rivet.identity.v1.IdentityService` gRPC service.

pub mod allocator;
pub mod backend;
pub mod cidr;
pub mod embedded_backend;
pub mod etcd_backend;
pub mod events;
pub mod heartbeat;
pub mod ipcache;
pub mod ipcache_service;
pub mod kubernetes_backend;
pub mod kubernetes_cluster;
pub mod node_service;
mod reconcile;
pub mod registry;
pub mod service;
pub mod snapshot;
mod store_watch;

/// The daemon's name: its socket is `<socket-dir>/svc-identity.sock`.
pub const DAEMON_NAME: &str = "svc-identity";

/// Capabilities svc-identity keeps: none (its store is a file in its state
/// dir or etcd on the network; it calls svc-loader over its socket).
pub const CAPABILITIES: &[rivet_common::privileges::Capability] = &[];

/// Methods that only read: members of the reader group may call them.
pub const READ_ONLY_METHODS: rivet_common::access::ReadOnlyMethods = &[
    (
        rivet_proto::identity::v1::identity_service_server::SERVICE_NAME,
        &[
            "GetIdentity",
            "LookupIdentity",
            "ListIdentities",
            "WatchIdentities",
            "GetStatus",
        ],
    ),
    (
        rivet_proto::identity::v1::ipcache_service_server::SERVICE_NAME,
        &["ListIpcache", "WatchIpcache"],
    ),
    (
        rivet_proto::identity::v1::node_service_server::SERVICE_NAME,
        &["ListNodes"],
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
