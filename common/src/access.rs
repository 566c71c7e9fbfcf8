//! Who may call what on a daemon's socket.
//!
//! The kernel vouches for every peer of a Unix socket: its uid, gid and pid
//! (SO_PEERCRED) and its supplementary groups (SO_PEERGROUPS), as they were
//! when it connected. An [`AccessPolicy`] turns them into an [`Access`]:
//!
//! - a uid in `full_uids` may call every method (root, and the daemons that
//!   drive this one: svc-endpoint calling svc-ipam, ...);
//! - otherwise a peer in one of `read_only_gids` (the reader group) may call
//!   the daemon's read-only methods — its own list plus [`ALWAYS_READ_ONLY`];
//! - anyone else is refused every call.
//!
//! A policy with neither list is open: every peer has full access (a daemon
//! started by hand or by a test without `--allowed-uids`).
//!
//! Refusals are per call, after the connection was accepted, so the caller
//! gets `PERMISSION_DENIED` naming its uid and the method (a dropped
//! connection would only say "transport error"). The socket file's mode and
//! group ([`crate::socket`]) are the first gate; this is the second.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use futures::future::BoxFuture;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tower::{Layer, Service};

/// The read-only methods of a daemon: `(gRPC service name, [method])`.
/// Methods not listed change state: only `full_uids` may call them.
pub type ReadOnlyMethods = &'static [(&'static str, &'static [&'static str])];

/// Methods every daemon serves that only read: the shared `Daemon` info
/// service and server reflection.
pub const ALWAYS_READ_ONLY: ReadOnlyMethods = &[
    ("rivet.daemon.v1.Daemon", &["GetInfo"]),
    ("grpc.reflection.v1.ServerReflection", &["ServerReflectionInfo"]),
    ("grpc.reflection.v1alpha.ServerReflection", &["ServerReflectionInfo"]),
];

/// The entries of `methods` that name no rpc `daemon`'s socket serves,
/// checked against the compiled descriptors of its `.proto` files and of
/// gRPC server reflection: each daemon's test of its read-only list.
///
/// ```
/// let methods: rivet_common::access::ReadOnlyMethods =
///     &[("rivet.ipam.v1.Ipam", &["List", "Lits"]), ("rivet.gc.v1.GcService", &["Status"])];
/// assert_eq!(
///     rivet_common::access::unknown_methods("svc-ipam", methods),
///     ["rivet.ipam.v1.Ipam/Lits", "rivet.gc.v1.GcService/Status"]
/// );
/// ```
pub fn unknown_methods(daemon: &str, methods: ReadOnlyMethods) -> Vec<String> {
    let served = crate::grpc::served_services(daemon);
    let is_served = |service: &str, method: &str| {
        served
            .iter()
            .any(|s| s.name == service && s.methods.iter().any(|m| m == method))
    };
    methods
        .iter()
        .flat_map(|(service, names)| names.iter().map(move |method| (*service, *method)))
        .filter(|(service, method)| !is_served(service, method))
        .map(|(service, method)| format!("{service}/{method}"))
        .collect()
}

/// A connected peer, as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its pid, when the kernel knows it.
    pub pid: Option<i32>,
    /// Its supplementary groups.
    pub groups: Vec<u32>,
}

impl Peer {
    /// A peer whose credentials are not known (they could not be read, or
    /// the request did not come through a Rivet listener).
    pub fn unknown() -> Self {
        Self {
            uid: u32::MAX,
            gid: u32::MAX,
            pid: None,
            groups: Vec::new(),
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "uid {}", self.uid)?;
        if let Some(pid) = self.pid {
            write!(f, " (pid {pid})")?;
        }
        Ok(())
    }
}

/// What a peer may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Every method.
    Full,
    /// Only the read-only methods.
    ReadOnly,
    /// Nothing.
    Denied,
}

/// Who may call what; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct AccessPolicy {
    /// Uids that may call every method.
    pub full_uids: Vec<u32>,
    /// Groups (primary or supplementary) whose members may call the read-only methods.
    pub read_only_gids: Vec<u32>,
    /// The daemon's read-only methods (besides [`ALWAYS_READ_ONLY`]).
    pub read_only_methods: ReadOnlyMethods,
}

/// Why a call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The peer may call nothing.
    NotAllowed,
    /// The peer may only read, and the method changes state.
    ReadOnly,
}

impl Refusal {
    /// As a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotAllowed => "not_allowed",
            Self::ReadOnly => "read_only",
        }
    }
}

impl AccessPolicy {
    /// Whether every peer has full access (no list given).
    pub fn is_open(&self) -> bool {
        self.full_uids.is_empty() && self.read_only_gids.is_empty()
    }

    /// What `peer` may do.
    ///
    /// ```
    /// use rivet_common::access::{Access, AccessPolicy, Peer};
    /// let policy = AccessPolicy { full_uids: vec![0, 999], read_only_gids: vec![995], ..Default::default() };
    /// let peer = |uid, groups: &[u32]| Peer { uid, gid: uid, pid: None, groups: groups.to_vec() };
    /// assert_eq!(policy.access(&peer(999, &[])), Access::Full);
    /// assert_eq!(policy.access(&peer(1000, &[100, 995])), Access::ReadOnly);
    /// assert_eq!(policy.access(&peer(1000, &[100])), Access::Denied);
    /// ```
    pub fn access(&self, peer: &Peer) -> Access {
        if self.is_open() || self.full_uids.contains(&peer.uid) {
            Access::Full
        } else if self
            .read_only_gids
            .iter()
            .any(|g| *g == peer.gid || peer.groups.contains(g))
        {
            Access::ReadOnly
        } else {
            Access::Denied
        }
    }

    /// Whether the gRPC path `/service/method` only reads.
    ///
    /// ```
    /// use rivet_common::access::AccessPolicy;
    /// let policy = AccessPolicy { read_only_methods: &[("rivet.ipam.v1.Ipam", &["List"])], ..Default::default() };
    /// assert!(policy.is_read_only("/rivet.ipam.v1.Ipam/List"));
    /// assert!(policy.is_read_only("/rivet.daemon.v1.Daemon/GetInfo"));
    /// assert!(!policy.is_read_only("/rivet.ipam.v1.Ipam/Allocate"));
    /// ```
    pub fn is_read_only(&self, path: &str) -> bool {
        let Some((service, method)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
            return false;
        };
        ALWAYS_READ_ONLY
            .iter()
            .chain(self.read_only_methods.iter())
            .any(|(s, methods)| *s == service && methods.contains(&method))
    }

    /// Whether a peer with `access` may call `path`.
    pub fn check(&self, access: Access, path: &str) -> Result<(), Refusal> {
        match access {
            Access::Full => Ok(()),
            Access::ReadOnly if self.is_read_only(path) => Ok(()),
            Access::ReadOnly => Err(Refusal::ReadOnly),
            Access::Denied => Err(Refusal::NotAllowed),
        }
    }

    /// The `PERMISSION_DENIED` message for `peer` refused `path` on `daemon`.
    pub fn refusal_message(&self, daemon: &str, peer: &Peer, path: &str, refusal: Refusal) -> String {
        let method = path.strip_prefix('/').unwrap_or(path);
        let full = join(&self.full_uids);
        match refusal {
            Refusal::NotAllowed => format!(
                "{daemon} refused {method} from {peer}: this uid may not call {daemon} \
                 (every call: uids {full}; read-only calls: members of gids {})",
                join(&self.read_only_gids)
            ),
            Refusal::ReadOnly => format!(
                "{daemon} refused {method} from {peer}: it changes state, and this uid may only make \
                 read-only calls (every call: uids {full})"
            ),
        }
    }
}

fn join(ids: &[u32]) -> String {
    if ids.is_empty() {
        return "none".into();
    }
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
}

/// The peer of one accepted connection and what it may do; every request
/// on the connection carries it (tonic's connect info).
#[derive(Debug, Clone)]
pub struct PeerAccess {
    /// The peer.
    pub peer: Peer,
    /// What it may do.
    pub access: Access,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeniedLabels {
    method: String,
    reason: &'static str,
}

/// A daemon socket's counters: calls refused by method and reason, the
/// connections open, and connections closed at once by the connection limit.
#[derive(Clone, Debug, Default)]
pub struct AccessMetrics {
    denied: Family<DeniedLabels, Counter>,
    connections: Gauge,
    connections_refused: Counter,
}

impl AccessMetrics {
    /// Registers `rivet_socket_calls_denied_total`, `rivet_socket_connections`
    /// and `rivet_socket_connections_refused_total` (prefix the registry
    /// with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let socket = registry.sub_registry_with_prefix("socket");
        socket.register(
            "calls_denied",
            "Calls refused by the daemon's socket access policy, by method and reason",
            self.denied.clone(),
        );
        socket.register(
            "connections",
            "Connections the daemon's socket holds open",
            self.connections.clone(),
        );
        socket.register(
            "connections_refused",
            "Connections closed at once because the socket held --max-connections (peers without full access)",
            self.connections_refused.clone(),
        );
    }

    /// Connections open now.
    pub fn connections(&self) -> i64 {
        self.connections.get()
    }

    /// Connections refused so far by the connection limit.
    pub fn connections_refused(&self) -> u64 {
        self.connections_refused.get()
    }

    /// A connection was admitted (its [`ConnectionSlot`] gives it back).
    pub(crate) fn connection_opened(&self) -> ConnectionSlot {
        self.connections.inc();
        ConnectionSlot {
            connections: self.connections.clone(),
        }
    }

    /// The event: a connection closed at once by the limit. Counted every
    /// time, logged at 1, 2, 4, 8, ... refusals so a peer opening
    /// connections in a loop cannot flood the log.
    pub(crate) fn connection_refused(&self, socket: &std::path::Path, peer: &Peer, limit: usize) {
        let refused = self.connections_refused.inc() + 1;
        if refused.is_power_of_two() {
            tracing::warn!(
                socket = %socket.display(),
                uid = peer.uid,
                pid = peer.pid,
                limit,
                refused,
                "the socket holds --max-connections connections: closed a new one from a peer without full access"
            );
        }
    }

    /// The event: a call refused. Logs it and counts it, by `method` (see
    /// [`AccessLayer`]: a path the daemon serves, or `unknown`).
    fn call_denied(&self, daemon: &str, peer: &Peer, path: &str, method: &str, refusal: Refusal) {
        tracing::warn!(
            daemon,
            uid = peer.uid,
            gid = peer.gid,
            pid = peer.pid,
            method = path,
            reason = refusal.as_str(),
            "call refused by the socket's access policy"
        );
        self.denied
            .get_or_create(&DeniedLabels {
                method: method.to_string(),
                reason: refusal.as_str(),
            })
            .inc();
    }
}

/// One admitted connection, counted in `rivet_socket_connections` until it
/// drops (with the connection).
#[derive(Debug)]
pub struct ConnectionSlot {
    connections: Gauge,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.connections.dec();
    }
}

/// Tower layer that refuses the calls a connection's peer may not make
/// (`PERMISSION_DENIED`); [`crate::grpc::serve_unix`] installs it.
#[derive(Clone, Debug)]
pub struct AccessLayer {
    daemon: &'static str,
    policy: Arc<AccessPolicy>,
    metrics: AccessMetrics,
    /// The paths (`/service/method`) the daemon serves: the only `method`
    /// labels of refusals, so that paths a client makes up cannot grow the
    /// metric without bound.
    served: Arc<HashSet<String>>,
}

impl AccessLayer {
    /// The layer of `daemon` enforcing `policy`.
    pub fn new(daemon: &'static str, policy: Arc<AccessPolicy>, metrics: AccessMetrics) -> Self {
        let served = crate::grpc::served_services(daemon)
            .into_iter()
            .flat_map(|s| s.methods.into_iter().map(move |m| format!("/{}/{m}", s.name)))
            .collect();
        Self {
            daemon,
            policy,
            metrics,
            served: Arc::new(served),
        }
    }

    /// The `method` label of a refused call to `path`.
    fn method_label<'a>(&self, path: &'a str) -> &'a str {
        if self.served.contains(path) { path } else { "unknown" }
    }
}

impl<S> Layer<S> for AccessLayer {
    type Service = AccessService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AccessService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service made by [`AccessLayer`].
#[derive(Clone, Debug)]
pub struct AccessService<S> {
    inner: S,
    layer: AccessLayer,
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for AccessService<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let layer = &self.layer;
        let path = request.uri().path();
        let verdict = match request.extensions().get::<PeerAccess>() {
            Some(p) => layer
                .policy
                .check(p.access, path)
                .map_err(|refusal| (p.peer.clone(), refusal)),
            // Not from a Rivet socket listener: only an open policy lets it through.
            None if layer.policy.is_open() => Ok(()),
            None => Err((Peer::unknown(), Refusal::NotAllowed)),
        };
        match verdict {
            Ok(()) => Box::pin(self.inner.call(request)),
            Err((peer, refusal)) => {
                layer
                    .metrics
                    .call_denied(layer.daemon, &peer, path, layer.method_label(path), refusal);
                let message = layer.policy.refusal_message(layer.daemon, &peer, path, refusal);
                let response = tonic::Status::permission_denied(message).into_http::<ResBody>();
                Box::pin(async move { Ok(response) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> AccessPolicy {
        AccessPolicy {
            full_uids: vec![0, 999],
            read_only_gids: vec![995],
            read_only_methods: &[("rivet.ipam.v1.Ipam", &["List"])],
        }
    }

    fn peer(uid: u32, gid: u32, groups: &[u32]) -> Peer {
        Peer {
            uid,
            gid,
            pid: Some(42),
            groups: groups.to_vec(),
        }
    }

    /// A member of the read-only group of [`policy`].
    fn operator() -> PeerAccess {
        PeerAccess {
            peer: peer(1000, 995, &[]),
            access: Access::ReadOnly,
        }
    }

    fn metrics_text(metrics: &AccessMetrics) -> String {
        let mut registry = Registry::with_prefix("rivet");
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn full_uids_read_only_groups_and_everyone_else() {
        let p = policy();
        assert_eq!(p.access(&peer(0, 0, &[])), Access::Full);
        assert_eq!(p.access(&peer(999, 994, &[995])), Access::Full, "the uid list wins");
        assert_eq!(p.access(&peer(1000, 995, &[])), Access::ReadOnly, "primary group");
        assert_eq!(
            p.access(&peer(1000, 1000, &[4, 995])),
            Access::ReadOnly,
            "supplementary group"
        );
        assert_eq!(p.access(&peer(1000, 1000, &[4])), Access::Denied);
        assert_eq!(
            AccessPolicy::default().access(&peer(1000, 1000, &[])),
            Access::Full,
            "no list: open"
        );
    }

    #[test]
    fn the_always_read_only_methods_are_served() {
        assert_eq!(unknown_methods("svc-test", ALWAYS_READ_ONLY), Vec::<String>::new());
    }

    #[test]
    fn read_only_peers_call_only_read_only_methods() {
        let p = policy();
        assert_eq!(p.check(Access::ReadOnly, "/rivet.ipam.v1.Ipam/List"), Ok(()));
        assert_eq!(p.check(Access::ReadOnly, "/rivet.daemon.v1.Daemon/GetInfo"), Ok(()));
        assert_eq!(
            p.check(Access::ReadOnly, "/rivet.ipam.v1.Ipam/Allocate"),
            Err(Refusal::ReadOnly)
        );
        // A method of the same name in another service is not read-only.
        assert_eq!(
            p.check(Access::ReadOnly, "/rivet.other.v1.Other/List"),
            Err(Refusal::ReadOnly)
        );
        assert_eq!(p.check(Access::ReadOnly, "List"), Err(Refusal::ReadOnly));
        assert_eq!(
            p.check(Access::Denied, "/rivet.daemon.v1.Daemon/GetInfo"),
            Err(Refusal::NotAllowed)
        );
        assert_eq!(p.check(Access::Full, "/rivet.ipam.v1.Ipam/Allocate"), Ok(()));
    }

    #[tokio::test]
    async fn the_layer_refuses_with_permission_denied_and_counts_by_method_and_reason() {
        use tower::ServiceExt as _;
        let metrics = AccessMetrics::default();
        let layer = AccessLayer::new("svc-ipam", Arc::new(policy()), metrics.clone());
        let reached = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let inner = {
            let reached = Arc::clone(&reached);
            tower::service_fn(move |_req: http::Request<()>| {
                reached.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok::<_, std::convert::Infallible>(http::Response::new(String::from("served"))) }
            })
        };
        let service = layer.layer(inner);
        let call = |path: &str, peer: Option<PeerAccess>| {
            let mut request = http::Request::builder().uri(path).body(()).unwrap();
            if let Some(peer) = peer {
                request.extensions_mut().insert(peer);
            }
            service.clone().oneshot(request)
        };
        let operator = operator();
        let ok = call("/rivet.ipam.v1.Ipam/List", Some(operator.clone())).await.unwrap();
        assert_eq!(ok.into_body(), "served");
        let refused = call("/rivet.ipam.v1.Ipam/Allocate", Some(operator)).await.unwrap();
        let status = tonic::Status::from_header_map(refused.headers()).expect("a gRPC status");
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(
            status.message().contains("uid 1000") && status.message().contains("rivet.ipam.v1.Ipam/Allocate"),
            "{}",
            status.message()
        );
        // A request that did not come through a Rivet listener: refused unless the policy is open.
        let anonymous = call("/rivet.ipam.v1.Ipam/List", None).await.unwrap();
        assert_eq!(
            tonic::Status::from_header_map(anonymous.headers()).map(|s| s.code()),
            Some(tonic::Code::PermissionDenied)
        );
        assert_eq!(
            reached.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "refused calls never reach the service"
        );
        let text = metrics_text(&metrics);
        assert!(
            text.contains(
                r#"rivet_socket_calls_denied_total{method="/rivet.ipam.v1.Ipam/Allocate",reason="read_only"} 1"#
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn refused_paths_the_daemon_does_not_serve_share_one_metric_label() {
        use tower::ServiceExt as _;
        let metrics = AccessMetrics::default();
        let layer = AccessLayer::new("svc-ipam", Arc::new(policy()), metrics.clone());
        let service = layer.layer(tower::service_fn(|_req: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        }));
        let operator = operator();
        // Paths a client makes up must not each make a series of their own.
        for path in [
            "/rivet.ipam.v1.Ipam/Allocate",
            "/rivet.ipam.v1.Ipam/Made1",
            "/made.Up/2",
        ] {
            let mut request = http::Request::builder().uri(path).body(()).unwrap();
            request.extensions_mut().insert(operator.clone());
            let refused = service.clone().oneshot(request).await.unwrap();
            assert_eq!(
                tonic::Status::from_header_map(refused.headers()).map(|s| s.code()),
                Some(tonic::Code::PermissionDenied),
                "{path}"
            );
        }
        let text = metrics_text(&metrics);
        assert!(
            text.contains(
                r#"rivet_socket_calls_denied_total{method="/rivet.ipam.v1.Ipam/Allocate",reason="read_only"} 1"#
            ) && text.contains(r#"rivet_socket_calls_denied_total{method="unknown",reason="read_only"} 2"#)
                && !text.contains("Made1")
                && !text.contains("made.Up"),
            "{text}"
        );
    }

    #[test]
    fn refusals_name_the_uid_and_the_method() {
        let p = policy();
        let m = p.refusal_message(
            "svc-ipam",
            &peer(65534, 65534, &[]),
            "/rivet.ipam.v1.Ipam/Allocate",
            Refusal::NotAllowed,
        );
        assert!(
            m.contains("uid 65534 (pid 42)") && m.contains("rivet.ipam.v1.Ipam/Allocate"),
            "{m}"
        );
        assert!(m.contains("uids 0, 999") && m.contains("gids 995"), "{m}");
        let m = p.refusal_message(
            "svc-ipam",
            &peer(1000, 995, &[]),
            "/rivet.ipam.v1.Ipam/Allocate",
            Refusal::ReadOnly,
        );
        assert!(m.contains("read-only") && m.contains("uid 1000"), "{m}");
    }
}
