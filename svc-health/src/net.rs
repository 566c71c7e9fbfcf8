//! The probes on the wire and the `/hello` server.
//!
//! - ICMP echo from an unprivileged ICMP socket (`SOCK_DGRAM`,
//!   `IPPROTO_ICMP`/`IPPROTO_ICMPV6`): the kernel picks the echo id, fills
//!   the checksum and hands this socket only its own replies, so probes run
//!   concurrently with no raw socket and no capability. The node namespace's
//!   `net.ipv4.ping_group_range` (which also governs ICMPv6 echo sockets)
//!   must include the daemon's group: `rivet node up` sets it there.
//! - HTTP GET `/hello` (status 200 expected) over a fresh TCP connection,
//!   one request, no pool: a probe measures a connection as a client makes
//!   it. The socket comes from a [`SocketSource`]: the node namespace, or
//!   the health endpoint's namespace (a probe through the pod datapath).
//! - [`serve_hello`]: the server peers probe, on port [`HEALTH_PORT`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpListener, TcpSocket, UdpSocket};

use crate::probe::{FailureKind, ProbeFailure, ProbeOutcome};

/// Cilium's health port: `/hello` on every node address and health endpoint.
pub const HEALTH_PORT: u16 = 4240;

/// The path peers probe.
pub const HELLO_PATH: &str = "/hello";

/// The kind of socket a probe asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketKind {
    /// TCP, for HTTP probes.
    Tcp,
    /// An unprivileged ICMP (or ICMPv6) echo socket.
    IcmpEcho,
}

/// Where a probe's sockets are made: the namespace a socket is made in is
/// the one its packets leave from.
pub trait SocketSource: Send + Sync {
    /// A fresh, non-blocking socket of `kind` for `address`'s family.
    fn socket(&self, kind: SocketKind, address: IpAddr) -> std::io::Result<Socket>;
}

/// A fresh, non-blocking socket of `kind` for `address`'s family, in the
/// calling thread's namespace.
pub fn new_socket(kind: SocketKind, address: IpAddr) -> std::io::Result<Socket> {
    let domain = Domain::for_address(SocketAddr::new(address, 0));
    let socket = match (kind, address) {
        (SocketKind::Tcp, _) => Socket::new(domain, Type::STREAM, Some(Protocol::TCP))?,
        (SocketKind::IcmpEcho, IpAddr::V4(_)) => Socket::new(domain, Type::DGRAM, Some(Protocol::ICMPV4))?,
        (SocketKind::IcmpEcho, IpAddr::V6(_)) => Socket::new(domain, Type::DGRAM, Some(Protocol::ICMPV6))?,
    };
    socket.set_nonblocking(true)?;
    Ok(socket)
}

/// Sockets of the calling thread's namespace: the daemon's own (the node's).
#[derive(Clone, Copy, Debug, Default)]
pub struct OwnNamespace;

impl SocketSource for OwnNamespace {
    fn socket(&self, kind: SocketKind, address: IpAddr) -> std::io::Result<Socket> {
        new_socket(kind, address)
    }
}

type SocketRequest = (SocketKind, IpAddr, std::sync::mpsc::Sender<std::io::Result<Socket>>);

/// Sockets of another network namespace, made by a thread that entered it
/// (a socket belongs to the namespace of the thread that made it, whatever
/// thread uses it later). The thread ends when this is dropped.
#[derive(Debug)]
pub struct NamespaceSockets {
    requests: std::sync::Mutex<std::sync::mpsc::Sender<SocketRequest>>,
    namespace: std::path::PathBuf,
}

impl NamespaceSockets {
    /// Starts the thread and moves it into the namespace at `path`
    /// (`/run/netns/<name>`); needs CAP_SYS_ADMIN for that, so call it
    /// before the privileges are dropped. The thread then drops every
    /// capability of its own: it only makes sockets.
    pub fn enter(path: &std::path::Path) -> std::io::Result<Self> {
        let file = std::fs::File::open(path)?;
        let (requests, incoming) = std::sync::mpsc::channel::<SocketRequest>();
        let (ready, entered) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("netns-sockets".into())
            .spawn(move || {
                let entered = nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
                    .and_then(|()| drop_thread_capabilities());
                drop(file);
                let ok = entered.is_ok();
                let _ = ready.send(entered);
                if !ok {
                    return;
                }
                while let Ok((kind, address, reply)) = incoming.recv() {
                    let _ = reply.send(new_socket(kind, address));
                }
            })?;
        entered
            .recv()
            .map_err(|_| std::io::Error::other("the namespace thread ended before entering"))??;
        Ok(Self {
            requests: std::sync::Mutex::new(requests),
            namespace: path.to_path_buf(),
        })
    }
}

/// Clears the calling thread's capability sets (capabilities are per
/// thread): a thread started before the daemon drops its privileges keeps
/// none of them.
fn drop_thread_capabilities() -> std::io::Result<()> {
    use caps::CapSet;
    for set in [
        CapSet::Ambient,
        CapSet::Inheritable,
        CapSet::Effective,
        CapSet::Permitted,
    ] {
        caps::clear(None, set)
            .map_err(|e| std::io::Error::other(format!("clearing the {set:?} capability set: {e}")))?;
    }
    Ok(())
}

impl SocketSource for NamespaceSockets {
    fn socket(&self, kind: SocketKind, address: IpAddr) -> std::io::Result<Socket> {
        let (reply, answer) = std::sync::mpsc::channel();
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((kind, address, reply))
            .map_err(|_| std::io::Error::other(format!("the thread in {} has ended", self.namespace.display())))?;
        answer
            .recv()
            .map_err(|_| std::io::Error::other(format!("the thread in {} has ended", self.namespace.display())))?
    }
}

/// An ICMP echo: an unprivileged ICMP socket, one request, its reply.
/// `seq` tells this probe's reply from a late one of an earlier probe.
pub async fn icmp_echo(sockets: &dyn SocketSource, address: IpAddr, seq: u16, timeout: Duration) -> ProbeOutcome {
    let (request_type, reply_type) = match address {
        IpAddr::V4(_) => (8u8, 0u8),
        IpAddr::V6(_) => (128u8, 129u8),
    };
    let socket = sockets.socket(SocketKind::IcmpEcho, address).map_err(|e| {
        ProbeFailure::new(
            FailureKind::Socket,
            format!(
                "opening an ICMP echo socket: {e} (the namespace's net.ipv4.ping_group_range must include this \
                 process's group; `rivet node up` sets it)"
            ),
        )
    })?;
    let socket = UdpSocket::from_std(socket.into()).map_err(|e| ProbeFailure::io("registering the ICMP socket", &e))?;

    // type, code, checksum (the kernel's), id (the kernel's), seq, payload.
    let mut request = vec![request_type, 0, 0, 0, 0, 0];
    request.extend_from_slice(&seq.to_be_bytes());
    request.extend_from_slice(b"rivet-health");
    let started = Instant::now();
    let exchange = async {
        socket
            .send_to(&request, SocketAddr::new(address, 0))
            .await
            .map_err(|e| ProbeFailure::io(&format!("sending an echo request to {address}"), &e))?;
        let mut reply = [0u8; 128];
        loop {
            let (n, from) = socket
                .recv_from(&mut reply)
                .await
                .map_err(|e| ProbeFailure::io(&format!("receiving the echo reply of {address}"), &e))?;
            // Only this socket's echo id reaches it; a late reply to an
            // earlier probe has another seq.
            if from.ip() == address && n >= 8 && reply[0] == reply_type && reply[6..8] == seq.to_be_bytes() {
                return Ok(started.elapsed());
            }
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(outcome) => outcome,
        Err(_) => Err(ProbeFailure::new(
            FailureKind::Timeout,
            format!("no echo reply from {address} within {timeout:?}"),
        )),
    }
}

/// A sequence for ICMP probes (wraps).
#[derive(Debug, Default)]
pub struct EchoSequence(AtomicU16);

impl EchoSequence {
    /// The next number.
    pub fn next(&self) -> u16 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}

/// HTTP GET `/hello` on `address:port` over a socket of `sockets`: the
/// round trip from connect to the response's status line.
pub async fn http_hello(sockets: &dyn SocketSource, address: IpAddr, port: u16, timeout: Duration) -> ProbeOutcome {
    let target = SocketAddr::new(address, port);
    let started = Instant::now();
    let exchange = async {
        let socket = sockets
            .socket(SocketKind::Tcp, address)
            .map(|s| TcpSocket::from_std_stream(s.into()))
            .map_err(|e| ProbeFailure::new(FailureKind::Socket, format!("making a TCP socket for {target}: {e}")))?;
        let stream = socket
            .connect(target)
            .await
            .map_err(|e| ProbeFailure::io(&format!("connecting to {target}"), &e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ProbeFailure::new(FailureKind::BadResponse, format!("HTTP handshake with {target}: {e}")))?;
        let connection = tokio::spawn(connection);
        let request = http::Request::get(HELLO_PATH)
            .header(http::header::HOST, target.to_string())
            .body(Empty::<bytes::Bytes>::new())
            .map_err(|e| ProbeFailure::new(FailureKind::Socket, format!("building the request: {e}")))?;
        let response = sender.send_request(request).await;
        connection.abort();
        let response = response
            .map_err(|e| ProbeFailure::new(FailureKind::BadResponse, format!("GET {target}{HELLO_PATH}: {e}")))?;
        if response.status() != http::StatusCode::OK {
            return Err(ProbeFailure::new(
                FailureKind::BadResponse,
                format!("GET {target}{HELLO_PATH}: status {}", response.status()),
            ));
        }
        Ok(started.elapsed())
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(outcome) => outcome,
        Err(_) => Err(ProbeFailure::new(
            FailureKind::Timeout,
            format!("GET {target}{HELLO_PATH}: no answer within {timeout:?}"),
        )),
    }
}

/// Why the `/hello` server failed.
#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    /// The address could not be bound.
    #[error("binding the health server on {address}: {source}")]
    Bind {
        /// Where.
        address: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Serving stopped with an error.
    #[error("serving the health server on {address}: {source}")]
    Serve {
        /// Where.
        address: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Binds `address` for [`serve_hello`] (a free port with port 0) on a
/// socket of `sockets` (its namespace). An IPv6 address binds IPv6 only, so
/// `0.0.0.0` and `::` can both be bound.
pub fn hello_listener(sockets: &dyn SocketSource, address: SocketAddr) -> Result<std::net::TcpListener, HelloError> {
    let bind = || -> std::io::Result<std::net::TcpListener> {
        let socket = sockets.socket(SocketKind::Tcp, address.ip())?;
        if address.is_ipv6() {
            socket.set_only_v6(true)?;
        }
        // A restarted daemon binds again at once (connections of the last
        // one may linger in TIME_WAIT).
        socket.set_reuse_address(true)?;
        socket.bind(&address.into())?;
        socket.listen(128)?;
        Ok(socket.into())
    };
    bind().map_err(|source| HelloError::Bind { address, source })
}

/// [`hello_listener`], registered with the runtime.
pub async fn bind_hello(sockets: &dyn SocketSource, address: SocketAddr) -> Result<TcpListener, HelloError> {
    TcpListener::from_std(hello_listener(sockets, address)?).map_err(|source| HelloError::Bind { address, source })
}

/// Answers `GET /hello` with 200 on `listener` until the future is dropped.
pub async fn serve_hello(listener: TcpListener) -> Result<(), HelloError> {
    let address = listener.local_addr().map_err(|source| HelloError::Bind {
        address: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })?;
    let app = Router::new().route(HELLO_PATH, get(|| async { "hello\n" }));
    tracing::info!(%address, "serving {HELLO_PATH} to peer probes");
    axum::serve(listener, app)
        .await
        .map_err(|source| HelloError::Serve { address, source })
}

/// The real probes, as the prober runs them.
#[derive(Clone)]
pub struct NetProbes {
    /// Sockets of the node namespace (underlay probes).
    pub node: Arc<dyn SocketSource>,
    /// Sockets of this node's health endpoint (probes through the pod
    /// datapath); `None`: the node has no health endpoint here.
    pub health_endpoint: Option<Arc<dyn SocketSource>>,
    /// The port peers serve `/hello` on.
    pub port: u16,
    /// ICMP sequence numbers.
    pub sequence: Arc<EchoSequence>,
}

impl std::fmt::Debug for NetProbes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetProbes")
            .field("health_endpoint", &self.health_endpoint.is_some())
            .field("port", &self.port)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hello_answers_and_a_closed_port_is_refused() {
        let listener = bind_hello(&OwnNamespace, "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(serve_hello(listener));
        let local = IpAddr::from([127, 0, 0, 1]);
        let latency = http_hello(&OwnNamespace, local, port, Duration::from_secs(2))
            .await
            .unwrap();
        assert!(latency < Duration::from_secs(2));
        server.abort();
        let _ = server.await;

        let failure = http_hello(&OwnNamespace, local, port, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert_eq!(failure.kind, FailureKind::Refused, "{failure}");
    }

    #[tokio::test]
    async fn a_server_that_is_not_hello_is_a_bad_response() {
        let listener = bind_hello(&OwnNamespace, "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = Router::new().route("/other", get(|| async { "" }));
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let failure = http_hello(
            &OwnNamespace,
            IpAddr::from([127, 0, 0, 1]),
            port,
            Duration::from_secs(2),
        )
        .await
        .unwrap_err();
        assert_eq!(failure.kind, FailureKind::BadResponse, "{failure}");
        assert!(failure.message.contains("404"), "{failure}");
        server.abort();
    }

    #[tokio::test]
    async fn a_silent_peer_times_out() {
        // Accepts (the kernel completes the handshake) but never answers.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let failure = http_hello(
            &OwnNamespace,
            IpAddr::from([127, 0, 0, 1]),
            port,
            Duration::from_millis(200),
        )
        .await
        .unwrap_err();
        assert_eq!(failure.kind, FailureKind::Timeout, "{failure}");
        drop(listener);
    }
}
