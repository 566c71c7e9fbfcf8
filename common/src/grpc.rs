//! gRPC over Unix sockets: serving a daemon (with the shared `Daemon` info
//! service and trace-context extraction), connecting to one (retry, backoff,
//! per-call deadlines, trace-context injection) and noticing when a server
//! restarted (`boot_id`, DESIGN.md §1).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper_util::rt::TokioIo;
use rivet_proto::daemon::v1 as pb;
use rivet_proto::{ErrorReason, HasBootId};
use tokio::net::UnixStream;
use tokio_stream::StreamExt as _;
use tonic::service::Routes;
use tonic::transport::{Channel, Endpoint, Server};
use tower::Layer;

use crate::access::AccessLayer;
use crate::backoff::Backoff;
use crate::controller::Controllers;
use crate::h2_authority::NormalizedAuthority;
use crate::socket::UnixSocketListener;
use crate::telemetry::{TraceContextClient, TraceContextClientLayer, TraceContextServerLayer};

/// Random identifier of one process start. Servers put it in every response a
/// client caches against; a client that sees it change replays its state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BootId(Arc<str>);

impl BootId {
    /// A fresh random boot id.
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().to_string().into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for BootId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&BootId> for String {
    fn from(b: &BootId) -> Self {
        b.0.to_string()
    }
}

/// Who a daemon process is; served by the `rivet.daemon.v1.Daemon` service
/// every daemon exposes.
#[derive(Debug, Clone)]
pub struct DaemonIdentity {
    /// Daemon name, e.g. `svc-ipam`; also its socket's file name.
    pub name: &'static str,
    /// Binary version.
    pub version: &'static str,
    /// Node this daemon serves.
    pub node_name: String,
    /// This process start's boot id.
    pub boot_id: BootId,
    /// Process start time.
    pub started_at: SystemTime,
}

impl DaemonIdentity {
    /// Identity of the current process with a fresh boot id.
    ///
    /// ```
    /// let id = rivet_common::grpc::DaemonIdentity::new("svc-ipam", env!("CARGO_PKG_VERSION"), "node-1".into());
    /// assert_eq!(id.boot_id.as_str().len(), 36);
    /// ```
    pub fn new(name: &'static str, version: &'static str, node_name: String) -> Self {
        Self {
            name,
            version,
            node_name,
            boot_id: BootId::random(),
            started_at: SystemTime::now(),
        }
    }

    /// The identity as the protobuf message.
    pub fn to_proto(&self) -> pb::DaemonInfo {
        pb::DaemonInfo {
            name: self.name.to_string(),
            version: self.version.to_string(),
            boot_id: self.boot_id.to_string(),
            node_name: self.node_name.clone(),
            started_at_unix: self
                .started_at
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or_default(),
            pid: std::process::id(),
            controllers: Vec::new(),
            degraded: String::new(),
        }
    }
}

/// `GetInfo`: who the daemon is and how its controllers are doing.
#[derive(Debug, Clone)]
struct DaemonInfoService {
    identity: DaemonIdentity,
    controllers: Controllers,
}

#[tonic::async_trait]
impl pb::daemon_server::Daemon for DaemonInfoService {
    async fn get_info(
        &self,
        _request: tonic::Request<pb::GetInfoRequest>,
    ) -> Result<tonic::Response<pb::DaemonInfo>, tonic::Status> {
        Ok(tonic::Response::new(pb::DaemonInfo {
            controllers: self.controllers.status().iter().map(|c| c.to_proto()).collect(),
            degraded: self.controllers.degraded().unwrap_or_default(),
            ..self.identity.to_proto()
        }))
    }
}

/// Why serving stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Rivet's own descriptors did not make a reflection service (a build bug).
    #[error("building gRPC server reflection for {daemon}: {reason}")]
    Reflection {
        /// Daemon name.
        daemon: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// The gRPC server failed.
    #[error("serving {daemon} on {path}: {source}")]
    Transport {
        /// Daemon name.
        daemon: &'static str,
        /// Socket path.
        path: PathBuf,
        /// The transport error.
        source: tonic::transport::Error,
    },
}

/// Serves `routes` plus the shared `Daemon` info service (the daemon's
/// `identity` and its `controllers`' state) on `listener` until `shutdown`
/// completes, then drains in-flight calls. Requests carry their
/// caller's trace context into the server span; calls the listener's access
/// policy does not allow the peer are refused with `PERMISSION_DENIED`.
///
/// ```no_run
/// # async fn run(routes: tonic::service::Routes) -> Result<(), Box<dyn std::error::Error>> {
/// use rivet_common::{grpc, socket};
/// let listener = socket::UnixSocketListener::bind("/tmp/x.sock".as_ref(), &Default::default())?;
/// let me = grpc::DaemonIdentity::new("svc-x", "0.1.0", "node-1".into());
/// let controllers = rivet_common::controller::Controllers::new();
/// grpc::serve_unix(listener, me, controllers, routes, grpc::shutdown_signal()).await?;
/// # Ok(()) }
/// ```
pub async fn serve_unix(
    listener: UnixSocketListener,
    identity: DaemonIdentity,
    controllers: Controllers,
    routes: Routes,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let path = listener.path().to_path_buf();
    let daemon = identity.name;
    tracing::info!(
        daemon,
        socket = %path.display(),
        boot_id = %identity.boot_id,
        node = %identity.node_name,
        "serving gRPC"
    );
    let access = AccessLayer::new(daemon, listener.access(), listener.access_metrics().clone());
    let advertised = reflected_services(daemon);
    let reflection = || {
        advertised.iter().fold(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(rivet_proto::FILE_DESCRIPTOR_SET),
            |builder, name| builder.with_service_name(name.clone()),
        )
    };
    let failed = |reason: tonic_reflection::server::Error| ServeError::Reflection {
        daemon,
        reason: reason.to_string(),
    };
    let reflection_v1 = reflection().build_v1().map_err(failed)?;
    // grpcurl and grpcio's reflection client still ask v1alpha first.
    let reflection_v1alpha = reflection().build_v1alpha().map_err(failed)?;
    let routes = routes
        .add_service(pb::daemon_server::DaemonServer::new(DaemonInfoService {
            identity,
            controllers,
        }))
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let (draining_tx, draining_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = draining_tx.send(());
    };
    // Clients of other languages send an :authority h2 refuses (the socket
    // path); see `h2_authority`.
    let incoming = listener
        .incoming()
        .map(|connection| connection.map(NormalizedAuthority::new));
    let serve = Server::builder()
        .layer(TraceContextServerLayer::default())
        .layer(access)
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming, signal);
    // Draining waits for clients to close their connections; long-lived
    // streams and idle channels of other daemons would hold it forever.
    let drain_deadline = async {
        if draining_rx.await.is_ok() {
            tokio::time::sleep(DRAIN_TIMEOUT).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        result = serve => result.map_err(|source| ServeError::Transport {
            daemon,
            path,
            source,
        }),
        () = drain_deadline => {
            tracing::warn!(daemon, timeout = ?DRAIN_TIMEOUT, "connections still open after the drain timeout; closing them");
            Ok(())
        }
    }
}

/// A gRPC service as its compiled descriptor declares it.
#[derive(Debug)]
pub(crate) struct ServiceDescriptor {
    /// Its proto package (`rivet.ipam.v1`).
    pub(crate) package: String,
    /// Its full name (`rivet.ipam.v1.Ipam`), as in a call's path.
    pub(crate) name: String,
    /// Its rpcs.
    pub(crate) methods: Vec<String>,
}

/// The services of an encoded `google.protobuf.FileDescriptorSet`.
fn services(encoded: &[u8]) -> impl Iterator<Item = ServiceDescriptor> {
    use prost::Message as _;
    prost_types::FileDescriptorSet::decode(encoded)
        .expect("a compiled FileDescriptorSet decodes")
        .file
        .into_iter()
        .flat_map(|file| {
            let package = file.package().to_string();
            file.service.into_iter().map(move |service| ServiceDescriptor {
                name: format!("{package}.{}", service.name()),
                methods: service.method.iter().map(|m| m.name().to_string()).collect(),
                package: package.clone(),
            })
        })
}

/// The Rivet services on `daemon`'s socket: the shared `rivet.daemon.v1.Daemon`
/// and those of its own package (`svc-ipam` → `rivet.ipam.v1`,
/// `svc-k8s-sync` → `rivet.k8s.v1`).
fn rivet_services(daemon: &str) -> impl Iterator<Item = ServiceDescriptor> {
    let api = daemon.trim_start_matches("svc-");
    let own = format!("rivet.{}.v1", api.strip_suffix("-sync").unwrap_or(api));
    services(rivet_proto::FILE_DESCRIPTOR_SET).filter(move |s| s.package == own || s.package == "rivet.daemon.v1")
}

/// Every service `daemon`'s socket serves: its Rivet services and gRPC
/// server reflection (v1 and v1alpha).
pub(crate) fn served_services(daemon: &str) -> Vec<ServiceDescriptor> {
    rivet_services(daemon)
        .chain(services(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET))
        .chain(services(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET))
        .collect()
}

/// The services gRPC reflection advertises on `daemon`'s socket: its Rivet
/// services, not the other daemons' (whose descriptors are served too, one
/// set for all).
pub fn reflected_services(daemon: &str) -> Vec<String> {
    let mut names: Vec<String> = rivet_services(daemon).map(|s| s.name).collect();
    names.sort();
    names
}

/// A gRPC code as a metric label (`invalid_argument`, `not_found`, ...),
/// so every daemon counts errors by kind with the same names.
///
/// ```
/// assert_eq!(rivet_common::grpc::code_label(tonic::Code::ResourceExhausted), "resource_exhausted");
/// ```
pub fn code_label(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "ok",
        Cancelled => "cancelled",
        Unknown => "unknown",
        InvalidArgument => "invalid_argument",
        DeadlineExceeded => "deadline_exceeded",
        NotFound => "not_found",
        AlreadyExists => "already_exists",
        PermissionDenied => "permission_denied",
        ResourceExhausted => "resource_exhausted",
        FailedPrecondition => "failed_precondition",
        Aborted => "aborted",
        OutOfRange => "out_of_range",
        Unimplemented => "unimplemented",
        Internal => "internal",
        Unavailable => "unavailable",
        DataLoss => "data_loss",
        Unauthenticated => "unauthenticated",
    }
}

/// A status whose cause is typed across processes (DESIGN.md §9): it
/// carries a `google.rpc.ErrorInfo` detail whose `reason` is `reason`'s name
/// as the API's proto declares it (`KVSTORE_UNREACHABLE`) and whose `domain`
/// is the API's (`identity.rivet.io`), so a client decides on the reason,
/// never on the message text.
///
/// ```
/// use rivet_common::grpc::{error_reason, status_with_reason};
/// use rivet_proto::identity::v1::ErrorReason;
/// let s = status_with_reason(tonic::Code::Unavailable, "the kvstore is unreachable", ErrorReason::KvstoreUnreachable);
/// assert_eq!(s.code(), tonic::Code::Unavailable);
/// assert_eq!(error_reason(&s), Some(ErrorReason::KvstoreUnreachable));
/// assert_eq!(error_reason::<ErrorReason>(&tonic::Status::unavailable("down")), None);
/// // Another API's reason is not this one's.
/// assert_eq!(error_reason::<rivet_proto::ipam::v1::ErrorReason>(&s), None);
/// ```
pub fn status_with_reason<R: ErrorReason>(code: tonic::Code, message: impl Into<String>, reason: R) -> tonic::Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let details = ErrorDetails::with_error_info(reason.name(), R::DOMAIN, std::collections::HashMap::new());
    tonic::Status::with_error_details(code, message, details)
}

/// The reason of API `R` a status carries (see [`status_with_reason`]);
/// `None` when it carries none, one of another domain, or a name this build
/// does not know.
pub fn error_reason<R: ErrorReason>(status: &tonic::Status) -> Option<R> {
    use tonic_types::StatusExt;
    status
        .get_details_error_info()
        .filter(|info| info.domain == R::DOMAIN)
        .and_then(|info| R::from_name(&info.reason))
}

/// A request's address field (`rivet_proto::net`: 4 or 16 bytes), or
/// INVALID_ARGUMENT naming the field.
///
/// ```
/// let err = rivet_common::grpc::address_field("entries[2].host_ip", b"198.18.0.5").unwrap_err();
/// assert_eq!(err.code(), tonic::Code::InvalidArgument);
/// assert_eq!(err.message(), "entries[2].host_ip: must be 4 or 16 bytes, got 10");
/// ```
pub fn address_field(field: &str, raw: &[u8]) -> Result<std::net::IpAddr, tonic::Status> {
    optional_address_field(field, raw)?.ok_or_else(|| invalid_field(field, "required"))
}

/// Like [`address_field`], but empty bytes are `None`.
pub fn optional_address_field(field: &str, raw: &[u8]) -> Result<Option<std::net::IpAddr>, tonic::Status> {
    rivet_proto::net::optional_address_from_bytes(raw).map_err(|e| invalid_field(field, e))
}

/// A request's prefix field (`rivet_proto::net::IpPrefix`, host bits zero),
/// or INVALID_ARGUMENT naming the field; unset is "required".
pub fn prefix_field(field: &str, raw: Option<&rivet_proto::net::IpPrefix>) -> Result<ipnet::IpNet, tonic::Status> {
    let raw = raw.ok_or_else(|| invalid_field(field, "required"))?;
    rivet_proto::net::prefix_from_proto(raw).map_err(|e| invalid_field(field, e))
}

/// A request's MAC field (6 bytes), or INVALID_ARGUMENT naming the field.
pub fn mac_field(field: &str, raw: &[u8]) -> Result<[u8; 6], tonic::Status> {
    rivet_proto::net::mac_from_bytes(raw).map_err(|e| invalid_field(field, e))
}

fn invalid_field(field: &str, reason: impl std::fmt::Display) -> tonic::Status {
    tonic::Status::invalid_argument(format!("{field}: {reason}"))
}

/// A failed call to a daemon whose API declares reasons `R`: the status it
/// answered (or the client's own, for an unreachable daemon or a missed
/// deadline) with its reason decoded. Clients decide on
/// [`reason`](Self::reason); the code only tells transport conditions
/// (UNAVAILABLE, DEADLINE_EXCEEDED) apart where no reason was sent.
///
/// ```
/// use rivet_common::grpc::{RpcError, status_with_reason};
/// use rivet_proto::ipam::v1::ErrorReason;
/// let e: RpcError<ErrorReason> = status_with_reason(tonic::Code::ResourceExhausted, "pool default is exhausted", ErrorReason::PoolExhausted).into();
/// assert!(e.is(ErrorReason::PoolExhausted));
/// assert_eq!(e.to_string(), "pool default is exhausted");
/// let e: RpcError<ErrorReason> = tonic::Status::unavailable("connecting failed").into();
/// assert_eq!(e.reason(), None);
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}", .status.message())]
pub struct RpcError<R: ErrorReason> {
    reason: Option<R>,
    status: tonic::Status,
}

impl<R: ErrorReason> RpcError<R> {
    /// The reason the server sent, if any.
    pub fn reason(&self) -> Option<R> {
        self.reason
    }

    /// Whether the server sent `reason`.
    pub fn is(&self, reason: R) -> bool {
        self.reason == Some(reason)
    }

    /// The status's code.
    pub fn code(&self) -> tonic::Code {
        self.status.code()
    }

    /// The status's message (for people, not for decisions).
    pub fn message(&self) -> &str {
        self.status.message()
    }

    /// The status as received.
    pub fn status(&self) -> &tonic::Status {
        &self.status
    }
}

impl<R: ErrorReason> From<tonic::Status> for RpcError<R> {
    fn from(status: tonic::Status) -> Self {
        Self {
            reason: error_reason(&status),
            status,
        }
    }
}

impl<R: ErrorReason> From<RpcError<R>> for tonic::Status {
    fn from(e: RpcError<R>) -> Self {
        e.status
    }
}

/// How long a stopping daemon lets in-flight calls finish.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Completes on SIGTERM or SIGINT (logging which), for graceful shutdown.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(signal = name, "shutting down");
}

/// A client channel to a daemon: a tonic channel over a Unix socket that
/// injects the caller's trace context into every request.
pub type DaemonChannel = TraceContextClient<Channel>;

/// How a client connects and how long calls may take.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Total time to keep retrying the first connection (daemon starting up).
    pub connect_timeout: Duration,
    /// Deadline of each call (and of reconnecting within a call).
    pub request_timeout: Duration,
    /// Delay between connection attempts.
    pub backoff: Backoff,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            backoff: Backoff::default(),
        }
    }
}

/// Why a client could not connect.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Every attempt within the connect timeout failed.
    #[error("connecting to {path} (gave up after {attempts} attempts in {waited:?}; is the daemon running?): {source}")]
    Unreachable {
        /// Socket path.
        path: PathBuf,
        /// Attempts made.
        attempts: u32,
        /// Time spent.
        waited: Duration,
        /// The last attempt's error.
        source: tonic::transport::Error,
    },
    /// The socket file's mode and group do not admit this user (retrying
    /// would not help).
    #[error(
        "connecting to {path}: permission denied by the socket file ({file}); run as root or as a member of its group"
    )]
    PermissionDenied {
        /// Socket path.
        path: PathBuf,
        /// Its mode, owner and group.
        file: String,
    },
}

/// Whether a connection attempt failed because the socket file refused us.
fn permission_denied(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::PermissionDenied
        {
            return true;
        }
        source = e.source();
    }
    false
}

fn describe_socket_file(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt as _;
    match std::fs::metadata(path) {
        Ok(m) => format!("mode {:04o}, uid {}, gid {}", m.mode() & 0o7777, m.uid(), m.gid()),
        Err(e) => e.to_string(),
    }
}

/// Connects to the daemon socket at `path`, retrying with backoff until
/// `options.connect_timeout`. Once connected the channel reconnects by itself
/// when the daemon restarts.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use rivet_common::grpc::{connect_unix, ClientOptions};
/// use rivet_proto::daemon::v1::{daemon_client::DaemonClient, GetInfoRequest};
/// let channel = connect_unix("/var/run/rivet/sockets/svc-ipam.sock".as_ref(), &ClientOptions::default()).await?;
/// let info = DaemonClient::new(channel).get_info(GetInfoRequest {}).await?.into_inner();
/// println!("{} boot {}", info.name, info.boot_id);
/// # Ok(()) }
/// ```
pub async fn connect_unix(path: &Path, options: &ClientOptions) -> Result<DaemonChannel, ConnectError> {
    connect_unix_counted(path, options).await.map(|c| c.channel)
}

/// A channel from [`connect_unix_counted`] and what connecting took.
#[derive(Debug)]
pub struct Connected {
    /// The channel.
    pub channel: DaemonChannel,
    /// Connection attempts, the successful one included (1: at once).
    pub attempts: u32,
    /// Time from the first attempt to the connection.
    pub waited: Duration,
}

/// [`connect_unix`], also telling how many attempts it took and how long
/// (a caller's span records them: right after a daemon restart the retries
/// are most of a call's time).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use rivet_common::grpc::{connect_unix_counted, ClientOptions};
/// let connected = connect_unix_counted("/var/run/rivet/sockets/svc-ipam.sock".as_ref(), &ClientOptions::default()).await?;
/// tracing::info!(attempts = connected.attempts, waited = ?connected.waited, "connected");
/// # Ok(()) }
/// ```
pub async fn connect_unix_counted(path: &Path, options: &ClientOptions) -> Result<Connected, ConnectError> {
    // The URI is required by tonic but unused: the connector dials the socket.
    let endpoint = Endpoint::from_static("http://rivet.invalid")
        .timeout(options.request_timeout)
        .connect_timeout(options.request_timeout);
    let started = Instant::now();
    let mut backoff = options.backoff.clone();
    let mut attempts = 0;
    loop {
        attempts += 1;
        let socket = path.to_path_buf();
        let connector = tower::service_fn(move |_: http::Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        });
        match endpoint.connect_with_connector(connector).await {
            Ok(channel) => {
                return Ok(Connected {
                    channel: TraceContextClientLayer.layer(channel),
                    attempts,
                    waited: started.elapsed(),
                });
            }
            Err(source) if permission_denied(&source) => {
                return Err(ConnectError::PermissionDenied {
                    path: path.to_path_buf(),
                    file: describe_socket_file(path),
                });
            }
            Err(source) => {
                let delay = backoff.next_delay();
                if started.elapsed() + delay > options.connect_timeout {
                    return Err(ConnectError::Unreachable {
                        path: path.to_path_buf(),
                        attempts,
                        waited: started.elapsed(),
                        source,
                    });
                }
                tracing::debug!(socket = %path.display(), attempt = attempts, ?delay, "daemon not reachable yet; retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// A channel to the daemon socket at `path` that connects on first use and
/// reconnects by itself: for long-running clients whose servers may start
/// later or restart (a call made while the server is down fails with
/// UNAVAILABLE). Each call gets `options.request_timeout`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use rivet_common::grpc::{connect_unix_lazy, ClientOptions};
/// // Nothing listens yet: creating the channel still succeeds.
/// let _channel = connect_unix_lazy("/nonexistent/svc-ipam.sock".as_ref(), &ClientOptions::default());
/// # }
/// ```
pub fn connect_unix_lazy(path: &Path, options: &ClientOptions) -> DaemonChannel {
    let endpoint = Endpoint::from_static("http://rivet.invalid")
        .timeout(options.request_timeout)
        .connect_timeout(options.request_timeout);
    let socket = path.to_path_buf();
    let connector = tower::service_fn(move |_: http::Uri| {
        let socket = socket.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
    });
    TraceContextClientLayer.layer(endpoint.connect_with_connector_lazy(connector))
}

/// tonic reports a connection that broke under a call (the server was
/// killed or restarted while the call was queued or running) as UNKNOWN
/// "transport error" or CANCELLED "operation was canceled" (hyper dropped
/// the queued request), not UNAVAILABLE. For a client it is the same as a
/// server that is down: retries keyed on UNAVAILABLE must retry it, and a
/// caller further up must learn that retrying is worth it. Such a status carries the client's
/// transport error as its source; a status the server sent has none and is
/// returned as is, like every other status.
pub fn connection_lost_is_unavailable(status: tonic::Status) -> tonic::Status {
    let transport = std::error::Error::source(&status).is_some();
    if transport && matches!(status.code(), tonic::Code::Unknown | tonic::Code::Cancelled) {
        tonic::Status::unavailable(format!("connection lost during the call: {}", status.message()))
    } else {
        status
    }
}

/// The deadline a server handler has for a request: the caller's
/// `grpc-timeout` (minus a margin to answer in time) or `default`.
///
/// ```
/// use std::time::Duration;
/// let mut request = tonic::Request::new(());
/// request.metadata_mut().insert("grpc-timeout", "5S".parse().unwrap());
/// let d = rivet_common::grpc::request_deadline(&request, Duration::from_secs(30));
/// assert_eq!(d, Duration::from_millis(4950));
/// ```
pub fn request_deadline<T>(request: &tonic::Request<T>, default: Duration) -> Duration {
    request
        .metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout)
        .map_or(default, |d| d.saturating_sub(Duration::from_millis(50)))
}

/// `grpc-timeout` header: digits and a unit (H M S m u n).
fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// A server restart noticed by a [`BootIdWatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerRestart {
    /// Which server (for logs).
    pub server: String,
    /// The boot id seen before.
    pub previous: String,
    /// The new boot id.
    pub current: String,
}

type RestartHook = Box<dyn Fn(&ServerRestart) + Send + Sync>;

/// Watches the `boot_id` of one server across responses and calls a hook
/// when it changes, so the client replays its desired state (level-triggered
/// resync, DESIGN.md §1). The first boot id seen never triggers the hook:
/// a client pushes its state on first contact anyway.
///
/// The hook runs inline; it should only schedule work (notify a task).
///
/// ```
/// use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
/// use rivet_common::grpc::BootIdWatch;
///
/// let resyncs = Arc::new(AtomicU32::new(0));
/// let counter = resyncs.clone();
/// let watch = BootIdWatch::new("svc-ipam", move |_| { counter.fetch_add(1, Ordering::SeqCst); });
/// watch.observe("a");
/// watch.observe("a");
/// watch.observe("b");
/// assert_eq!(resyncs.load(Ordering::SeqCst), 1);
/// ```
pub struct BootIdWatch {
    server: String,
    last: Mutex<Option<String>>,
    hook: RestartHook,
}

impl std::fmt::Debug for BootIdWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootIdWatch")
            .field("server", &self.server)
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl BootIdWatch {
    /// A watch for `server` that calls `hook` on every observed restart.
    pub fn new(server: impl Into<String>, hook: impl Fn(&ServerRestart) + Send + Sync + 'static) -> Self {
        Self {
            server: server.into(),
            last: Mutex::new(None),
            hook: Box::new(hook),
        }
    }

    /// Records a boot id; returns the restart (after calling the hook) when
    /// it differs from the previous one. Empty ids are ignored.
    pub fn observe(&self, boot_id: &str) -> Option<ServerRestart> {
        if boot_id.is_empty() {
            return None;
        }
        let restart = {
            let mut last = self.last.lock().expect("boot id lock poisoned");
            match last.replace(boot_id.to_string()) {
                Some(previous) if previous != boot_id => Some(ServerRestart {
                    server: self.server.clone(),
                    previous,
                    current: boot_id.to_string(),
                }),
                _ => None,
            }
        };
        if let Some(r) = &restart {
            tracing::info!(server = %r.server, previous = %r.previous, current = %r.current, "server restarted; resyncing");
            (self.hook)(r);
        }
        restart
    }

    /// [`observe`](Self::observe) for any message carrying a boot id.
    pub fn observe_message<M: HasBootId>(&self, message: &M) -> Option<ServerRestart> {
        self.observe(message.boot_id())
    }

    /// The last boot id seen.
    pub fn current(&self) -> Option<String> {
        self.last.lock().expect("boot id lock poisoned").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::socket::SocketOptions;
    use pb::daemon_client::DaemonClient;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tokio::sync::oneshot;

    struct RunningDaemon {
        stop: Option<oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<Result<(), ServeError>>,
    }

    impl RunningDaemon {
        fn start(path: &Path, node: &str) -> Self {
            let listener = UnixSocketListener::bind(path, &SocketOptions::default()).expect("bind test socket");
            let (tx, rx) = oneshot::channel();
            let identity = DaemonIdentity::new("svc-test", "0.0.0", node.to_string());
            let task = tokio::spawn(serve_unix(
                listener,
                identity,
                Controllers::new(),
                Routes::default(),
                async {
                    let _ = rx.await;
                },
            ));
            Self { stop: Some(tx), task }
        }

        async fn stop(mut self) {
            let _ = self.stop.take().unwrap().send(());
            self.task.await.unwrap().expect("graceful shutdown must not fail");
        }
    }

    #[tokio::test]
    async fn client_sees_restart_and_resyncs_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("svc-test.sock");
        let daemon = RunningDaemon::start(&path, "n1");

        let channel = connect_unix(&path, &ClientOptions::default())
            .await
            .expect("connect to a live daemon");
        let mut client = DaemonClient::new(channel);
        let resyncs = Arc::new(AtomicU32::new(0));
        let counter = resyncs.clone();
        let watch = BootIdWatch::new("svc-test", move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        });

        let first = client.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
        assert_eq!(first.name, "svc-test");
        assert_eq!(first.node_name, "n1");
        assert!(
            watch.observe_message(&first).is_none(),
            "first contact is not a restart"
        );

        daemon.stop().await;
        assert!(!path.exists(), "a gracefully stopped daemon removes its socket");
        let daemon = RunningDaemon::start(&path, "n1");

        // The same channel reconnects to the new process by itself.
        let mut second = None;
        for _ in 0..50 {
            match client.get_info(pb::GetInfoRequest {}).await {
                Ok(r) => {
                    second = Some(r.into_inner());
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        let second = second.expect("the channel must reconnect to the restarted daemon");
        assert_ne!(first.boot_id, second.boot_id, "every process start has a new boot id");
        let restart = watch.observe_message(&second).expect("a new boot id is a restart");
        assert_eq!(restart.previous, first.boot_id);
        watch.observe_message(&second);
        assert_eq!(
            resyncs.load(Ordering::SeqCst),
            1,
            "one restart triggers exactly one resync"
        );
        daemon.stop().await;
    }

    #[tokio::test]
    async fn connect_gives_up_with_the_socket_path_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.sock");
        let options = ClientOptions {
            connect_timeout: Duration::from_millis(200),
            ..ClientOptions::default()
        };
        let err = connect_unix(&path, &options).await.expect_err("nobody listens");
        let text = err.to_string();
        assert!(text.contains("absent.sock"), "the error must name the socket: {text}");
    }

    #[tokio::test]
    async fn connect_waits_for_a_daemon_that_starts_late() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("late.sock");
        let starter = {
            let path = path.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                RunningDaemon::start(&path, "n1")
            })
        };
        let channel = connect_unix(&path, &ClientOptions::default())
            .await
            .expect("the client keeps retrying until the daemon is up");
        let info = DaemonClient::new(channel)
            .get_info(pb::GetInfoRequest {})
            .await
            .unwrap();
        assert_eq!(info.into_inner().name, "svc-test");
        starter.await.unwrap().stop().await;
    }

    #[tokio::test]
    async fn a_connection_cut_under_a_call_is_unavailable_a_sent_status_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dies.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        // A "server" that accepts and hangs up at once.
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
        });
        let channel = connect_unix_lazy(&path, &ClientOptions::default());
        let cut = pb::daemon_client::DaemonClient::new(channel)
            .get_info(pb::GetInfoRequest {})
            .await
            .unwrap_err();
        assert!(
            matches!(cut.code(), tonic::Code::Unknown | tonic::Code::Cancelled),
            "tonic's own code for a cut connection: {cut:?}"
        );
        assert_eq!(
            super::connection_lost_is_unavailable(cut).code(),
            tonic::Code::Unavailable
        );
        for sent in [
            tonic::Status::cancelled("by the server"),
            tonic::Status::unknown("by the server"),
        ] {
            let code = sent.code();
            assert_eq!(
                super::connection_lost_is_unavailable(sent).code(),
                code,
                "a status the server sent is kept"
            );
        }
    }

    #[test]
    fn reflection_advertises_a_daemons_own_services_and_the_shared_one() {
        assert_eq!(
            reflected_services("svc-ipam"),
            ["rivet.daemon.v1.Daemon", "rivet.ipam.v1.Ipam"]
        );
        assert_eq!(
            reflected_services("svc-endpoint"),
            [
                "rivet.daemon.v1.Daemon",
                "rivet.endpoint.v1.EndpointService",
                "rivet.endpoint.v1.NamespaceService",
                "rivet.endpoint.v1.PodMetadataService",
                "rivet.endpoint.v1.PolicyService",
                "rivet.endpoint.v1.ServiceCatalogService",
            ]
        );
        assert_eq!(
            reflected_services("svc-k8s-sync"),
            [
                "rivet.daemon.v1.Daemon",
                "rivet.k8s.v1.KubernetesSyncService",
                "rivet.k8s.v1.PodDirectory",
            ]
        );
        assert_eq!(reflected_services("svc-test"), ["rivet.daemon.v1.Daemon"]);
    }

    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("x"), None);
        assert_eq!(parse_grpc_timeout(""), None);
    }
}
