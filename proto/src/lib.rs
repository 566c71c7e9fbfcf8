//! Generated gRPC contracts of every Rivet daemon, one module per API.
//!
//! Every response or stream message a client caches against carries the
//! server's `boot_id` (see [`HasBootId`]); a client that sees it change replays
//! its desired state (DESIGN.md §1).

/// Common to every daemon: who answers (`rivet.daemon.v1`).
pub mod daemon {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.daemon.v1");
    }
}

/// svc-ipam (`rivet.ipam.v1`).
pub mod ipam {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.ipam.v1");
    }
}

/// A message that carries the `boot_id` of the server that produced it.
pub trait HasBootId {
    /// The server's boot id (random per process start).
    fn boot_id(&self) -> &str;
}

macro_rules! has_boot_id {
    ($($ty:path),* $(,)?) => {
        $(impl HasBootId for $ty {
            fn boot_id(&self) -> &str {
                &self.boot_id
            }
        })*
    };
}

has_boot_id!(
    daemon::v1::DaemonInfo,
    ipam::v1::AllocateResponse,
    ipam::v1::ReleaseResponse,
    ipam::v1::ListResponse,
);
