//! svc-loader: the only privileged daemon. (Work in progress.)

pub mod datapath;
pub mod maps;
pub mod netdev;
pub mod policy_lpm;

/// The daemon's name: its socket is `<socket-dir>/svc-loader.sock`.
pub const DAEMON_NAME: &str = "svc-loader";

/// The datapath object compiled by build.rs from `bpf/datapath.c`.
pub static DATAPATH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/datapath.o"));
