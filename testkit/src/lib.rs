//! rivet-testkit: the harnesses of Rivet's cross-process tests and
//! benchmarks, kept out of the daemons' crates so that no daemon, the CLI or
//! the CNI plugin links test code or, for the unprivileged ones, aya and
//! svc-loader (DESIGN.md §2, §8). Dev-only: tests take it as a
//! dev-dependency, rivet-bench as a dependency of its binary.
//!
//! - [`node`]: a whole node as real processes ([`node::EndpointNode`]:
//!   svc-loader in a node namespace, svc-identity, svc-ipam, svc-endpoint)
//!   and pods wired to it;
//! - [`cgroup`]: a cgroup v2 directory of the test's (socket-level load
//!   balancing), processes started in it, and the socket probe (what
//!   connect, getpeername and recvfrom see from inside);
//! - [`cluster`]: a multi-node cluster made by the real `rivet cluster up`
//!   (etcd, an underlay bridge, node namespaces each running `rivet node
//!   up`), pods on any node, node stop/crash/restart, waiting for
//!   convergence;
//! - [`chaos`]: a randomised churn of pods, policies, daemon kills and
//!   etcd restarts on such a cluster, with Rivet's invariants checked
//!   throughout and nothing left at the end (`cargo xtask chaos`);
//! - [`loader`]: a node namespace with pods and svc-loader only
//!   ([`loader::LoaderNode`]), and policy entries for it;
//! - [`gc`]: the datapath's maps pinned for svc-gc, synthetic conntrack
//!   entries, the svc-gc command;
//! - [`kube`]: a real kube-apiserver with its own etcd, per-test PKI, RBAC,
//!   an admin client, Rivet's CRDs and ServiceAccounts bound to deploy/'s RBAC;
//! - [`monitor`]: the drops of `rivet monitor -o json`;
//! - [`policy_matrix`]: the NetworkPolicy reachability table (3 namespaces
//!   × 3 pods, a policy per case, the expected matrix) and its runner, on
//!   one node or spread over a cluster's nodes;
//! - [`operator`]: rivet-operator as a process with its ServiceAccount,
//!   killed, stopped and restarted by tests, waited on through its Lease;
//! - [`scale`]: the load generator of the scale tests and benchmark
//!   (simulated nodes publishing pods in etcd, each on its own lease) and a
//!   node whose pinned ipcache is read directly;
//! - [`relay`]: a TCP relay a test cuts (a partition between one client
//!   and a server);
//! - [`traffic`]: a flood ping counted in runs (no packet lost across a
//!   restart);
//! - [`service`]: service traffic attributed to its backend (a server
//!   answering with its pod's name, new and held connections, a counted
//!   UDP stream);
//! - [`cni`]: running a CNI plugin the way a container runtime does;
//! - [`frames`]: raw frames built by hand and sent from an interface;
//! - [`jaeger`]: a real Jaeger v2 for trace tests, read back through its
//!   query API, and OTLP relays into node namespaces;
//! - [`tools`]: where the Go-built tools (Kubernetes, etcd 3.6, Jaeger) are;
//! - [`wire`]: addresses and prefixes written as text, in their wire form.
//!
//! Namespaces, processes and pins come from `rivet_common::testing` and are
//! removed on drop, also on panic.

pub mod cgroup;
pub mod chaos;
pub mod cluster;
pub mod cni;
pub mod frames;
pub mod gc;
pub mod jaeger;
pub mod kube;
pub mod loader;
pub mod monitor;
pub mod node;
pub mod operator;
pub mod policy_matrix;
pub mod relay;
pub mod scale;
pub mod service;
pub mod tools;
pub mod traffic;
pub mod wire;
