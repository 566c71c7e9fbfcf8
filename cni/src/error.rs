//! The CNI error result (`{cniVersion, code, msg, details}`) and the codes
//! rivet-cni uses: the spec's well-known ones below 100, its own from 100.

use std::fmt;

use serde_json::{Value, json};

/// Error codes. 1-99 are the spec's well-known codes; 100 and up are
/// rivet-cni's own (listed in the crate README).
pub mod codes {
    /// The netconf's `cniVersion` is not supported (or the verb needs a newer one).
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// A field of the netconf is not supported; the message names key and value.
    pub const UNSUPPORTED_FIELD: u32 = 2;
    /// The container is unknown or does not exist.
    pub const UNKNOWN_CONTAINER: u32 = 3;
    /// A `CNI_*` environment variable is missing or invalid; the message names it.
    pub const INVALID_ENVIRONMENT: u32 = 4;
    /// Reading stdin or writing stdout failed.
    pub const IO_FAILURE: u32 = 5;
    /// The netconf (or a result in it) could not be decoded.
    pub const DECODE: u32 = 6;
    /// The netconf is decodable but invalid.
    pub const INVALID_NETCONF: u32 = 7;
    /// A transient condition (a daemon restarting, a deadline): retry later.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// svc-ipam or svc-endpoint is unreachable: the plugin cannot service ADD.
    pub const NOT_AVAILABLE: u32 = 50;

    /// Setting up or removing interfaces, addresses or routes failed.
    pub const NETLINK: u32 = 100;
    /// svc-ipam refused the allocation (pool exhausted, address taken, ...).
    pub const IPAM: u32 = 101;
    /// svc-endpoint refused or could not complete the endpoint.
    pub const ENDPOINT: u32 = 102;
    /// The host-side interface of this attachment exists already (ADD
    /// repeated without DEL, or a host interface name collision).
    pub const ALREADY_EXISTS: u32 = 103;
    /// CHECK found the attachment differs from what ADD set up.
    pub const CHECK_FAILED: u32 = 104;
    /// The delegated IPAM plugin could not be run or returned nonsense.
    pub const DELEGATED_IPAM: u32 = 105;
    /// A bug in rivet-cni (a panic).
    pub const INTERNAL: u32 = 199;
}

/// A CNI error: printed on stdout as the spec's error JSON, with a non-zero
/// exit status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    /// The error code ([`codes`]).
    pub code: u32,
    /// Short message.
    pub msg: String,
    /// Longer explanation; empty when there is none.
    pub details: String,
}

impl CniError {
    /// An error with a message and no details.
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// Sets the details.
    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// Prefixes the message with what was being done.
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }

    /// Invalid environment variable.
    pub fn env(msg: impl Into<String>) -> Self {
        Self::new(codes::INVALID_ENVIRONMENT, msg)
    }

    /// Invalid network configuration.
    pub fn netconf(msg: impl Into<String>) -> Self {
        Self::new(codes::INVALID_NETCONF, msg)
    }

    /// Undecodable input.
    pub fn decode(msg: impl Into<String>) -> Self {
        Self::new(codes::DECODE, msg)
    }

    /// The spec's error JSON for a result in `cni_version`.
    ///
    /// ```
    /// use rivet_cni::error::{CniError, codes};
    /// let json = CniError::new(codes::IPAM, "pool exhausted").to_json("1.0.0");
    /// assert_eq!(json["code"], 101);
    /// assert_eq!(json["cniVersion"], "1.0.0");
    /// assert!(json.get("details").is_none());
    /// ```
    pub fn to_json(&self, cni_version: &str) -> Value {
        let mut value = json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
        });
        if !self.details.is_empty() {
            value["details"] = Value::String(self.details.clone());
        }
        value
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CNI error {}: {}", self.code, self.msg)?;
        if !self.details.is_empty() {
            write!(f, " ({})", self.details)?;
        }
        Ok(())
    }
}

impl std::error::Error for CniError {}
