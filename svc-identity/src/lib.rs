//! svc-identity: label sets → cluster-wide security identities in etcd (or
//! the embedded store on a single node), reserved identities, and the IP
//! cache (IP → identity) published to the store and pushed to svc-loader.
//!
//! - [`backend`]: the store trait and its key layout;
//! - [`allocator`]: allocation, local references, the identity cache and the
//!   sync loop that re-creates this node's keys;
//! - [`service`]: the `rivet.identity.v1.IdentityService` gRPC service.

pub mod allocator;
pub mod backend;
pub mod service;

/// The daemon's name: its socket is `<socket-dir>/svc-identity.sock`.
pub const DAEMON_NAME: &str = "svc-identity";
