//! rivet-operator: Rivet's cluster-scope duties (DESIGN.md §9). One
//! replica at a time leads, elected on a `coordination.k8s.io/v1` Lease;
//! only the leader runs the duties, and none of them is in the datapath: a
//! cluster without an operator keeps forwarding.
//!
//! - [`term`]: a term of leadership and the [`term::Duty`] trait every duty
//!   implements; writes are fenced on [`term::Term::ensure`].
//! - [`leader`]: the elector (client-go's algorithm on a Lease) that
//!   begins and ends terms and starts the duties for each.
//! - [`cluster_pool`]: the `cluster-pool` duty (pod CIDRs per node from
//!   the cluster pool, RivetNodes for Nodes and their deletion when the
//!   Node is gone).
//! - [`kvstore`]: the etcd flags and client shared by the kvstore duties.
//! - [`identity_gc`]: identity garbage collection (etcd keys or
//!   RivetIdentity objects), two rounds fenced on the version.
//! - [`stale`]: duty `stale-objects`: RivetEndpoints of gone pods deleted,
//!   the not-ready taint put back on Nodes whose RivetNode is not ready.
//! - [`heartbeat`]: duty `kvstore-heartbeat`, the time at `.heartbeat`.
//! - [`kvstore_mirror`]: duty `kvstore-mirror`, RivetNodes and shared
//!   Services into `nodes/v1` and `services/v1`.

pub mod cluster_pool;
pub mod heartbeat;
pub mod identity_gc;
pub mod kvstore;
pub mod kvstore_mirror;
pub mod leader;
pub mod stale;
pub mod term;
mod watch_cache;
