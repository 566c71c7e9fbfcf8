//! rivet-cni: Rivet's CNI plugin (spec 1.1; netconfs of 0.3.0 to 1.1.0).
//!
//! One short-lived root process per runtime call. ADD gets addresses from
//! svc-ipam (or a delegated IPAM plugin), wires a veth pair between the node
//! namespace and the container namespace the way Rivet's datapath expects
//! (DESIGN.md §8: addresses without prefix route, everything via a gateway
//! the datapath answers for, host routes to the pod), then has svc-endpoint
//! create the endpoint synchronously, so the pod starts with its identity and
//! policy in place. Any failure undoes everything done. After another plugin
//! (`prevResult`), it only creates the endpoint for that plugin's veth.
//!
//! Layout: the logic is in [`plugin`] over the traits of [`api`] (netlink,
//! the two daemons, delegated IPAM plugins); [`env`](mod@env), [`netconf`] and
//! [`result`] are the spec's formats; [`netlink`], [`grpc`] and [`delegate`]
//! are the real implementations; [`logging`] sends logs to the `logFile` and
//! spans over OTLP; [`install`] puts the plugin into a runtime's CNI dirs
//! (`rivet-cni install`). `main.rs` reads the environment and stdin and wires them.
//! Running the binary the way a runtime does, for the cross-process tests
//! and the `cni` benchmark, is rivet-testkit's (`rivet_testkit::cni`).

pub mod api;
pub mod delegate;
pub mod env;
pub mod error;
pub mod grpc;
pub mod install;
pub mod logging;
pub mod naming;
pub mod netconf;
pub mod netlink;
pub mod plugin;
pub mod result;
pub mod version;

use serde_json::Value;

use crate::error::CniError;
use crate::version::CniVersion;

/// What an invocation ends with: a result to print (ADD, VERSION), nothing
/// (DEL, CHECK, STATUS, GC) or an error.
pub type Outcome = Result<Option<Value>, CniError>;

/// The text to print on stdout and the exit status for an outcome; errors
/// are rendered in `version` (the netconf's when known).
///
/// ```
/// use rivet_cni::{error::CniError, render_outcome, version::CniVersion};
/// let (out, status) = render_outcome(&Err(CniError::new(4, "CNI_NETNS is not set")), CniVersion::V1_0_0);
/// assert_eq!(status, 1);
/// assert!(out.unwrap().contains("\"code\":4"));
/// assert_eq!(render_outcome(&Ok(None), CniVersion::V1_0_0), (None, 0));
/// ```
pub fn render_outcome(outcome: &Outcome, version: CniVersion) -> (Option<String>, u8) {
    match outcome {
        Ok(Some(value)) => (Some(value.to_string()), 0),
        Ok(None) => (None, 0),
        Err(e) => (Some(e.to_json(version.as_str()).to_string()), 1),
    }
}
