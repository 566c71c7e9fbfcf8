//! Pieces every Rivet daemon shares, so that six daemons look and behave alike:
//!
//! - [`socket`] and [`grpc`]: gRPC over Unix sockets (single instance per
//!   socket, client retry and deadlines, restart detection by `boot_id`);
//!   [`h2_authority`]: the `:authority` fix that lets gRPC clients of other
//!   languages in (grpcio sends the socket path);
//! - [`access`]: who may call what on a socket (peer credentials, full or
//!   read-only access per method);
//! - [`privileges`]: the user and capabilities a daemon drops to at start;
//! - [`telemetry`]: logs plus OTLP traces, W3C trace context across processes;
//! - [`config`]: flags + env + config dir, and the flags all daemons share;
//! - [`state_file`]: crash-safe, versioned state files;
//! - [`metrics`]: Prometheus metrics and `/healthz`;
//! - [`daemon`]: the run loop a daemon's `main` ends with;
//! - [`malloc`]: the C allocator's settings a daemon's `main` starts with;
//! - [`labels`]: security labels (`source:key=value`), label sets, reserved
//!   identities, namespace labels and the identity-relevant label filter;
//! - [`controller`]: supervised background loops (reconcile or run for
//!   ever; restarted on panic or end, counted, shown in `rivet status`);
//! - [`backoff`]: retry delays;
//! - [`identity`]: the numeric identity ranges (reserved, cluster, CIDR);
//! - [`intern`]: interned strings (label keys and values shared by every
//!   identity);
//! - [`named_port`]: the rule for named container ports' names;
//! - [`mac`]: MAC addresses as text;
//! - [`pin_layout`]: where a node's datapath maps are pinned (aya-free;
//!   `rivet_datapath::pin` re-exports it);
//! - [`k8s_name`]: Kubernetes name rules (DNS-1123 labels and subdomains,
//!   namespace names, label keys and values);
//! - [`cluster`]: the node and service records the kvstore holds
//!   (`nodes/v1`, `services/v1`), written by rivet-operator.

pub mod access;
pub mod backoff;
pub mod cluster;
pub mod config;
pub mod controller;
pub mod daemon;
pub mod etcd_probe;
pub mod grpc;
pub mod h2_authority;
pub mod identity;
pub mod intern;
pub mod k8s_name;
pub mod labels;
pub mod mac;
pub mod malloc;
pub mod metrics;
pub mod named_port;
pub mod pin_layout;
pub mod privileges;
pub mod socket;
pub mod state_file;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
