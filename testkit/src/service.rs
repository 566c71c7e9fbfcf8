//! Service traffic a test can attribute to a backend: [`NameServer`], a
//! TCP and UDP server in a pod that answers every request with the pod's
//! name, and its clients — [`ask_name`] (one new connection),
//! [`HeldConnection`] (one connection asked again and again, held across a
//! change), [`connect_and_reset`] (many short connections from chosen
//! ports) and [`UdpStream`] (datagrams in lockstep, counted, for "no packet
//! lost" across a restart).
//!
//! The protocol: over TCP, every chunk the client writes is answered with
//! `<name>\n` ([`NameServer::start_reporting_peer`]: `<name> <the client's
//! address as the server saw it>\n`, for NAT tests); over UDP, every
//! datagram with `<name> <the datagram>`.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rivet_common::testing::netns::{NetNs, NetnsError};

/// How long a [`UdpStream`] waits for each answer before it counts the
/// datagram lost.
pub const UDP_ANSWER_TIMEOUT: Duration = Duration::from_secs(1);

/// A server answering with a name on TCP and UDP at each of its addresses,
/// inside a pod's namespace; stops on drop.
pub struct NameServer {
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl NameServer {
    /// Serves `name` on TCP and UDP at each of `addrs` (bound in `netns`).
    pub fn start(netns: &NetNs, name: &str, addrs: &[SocketAddr]) -> Result<Self, NetnsError> {
        Self::serve(netns, name, addrs, false)
    }

    /// [`start`](Self::start), but TCP answers name the client's address as
    /// the server saw it too: `<name> <address>` (split with
    /// [`name_and_peer`]), so a test sees whether a NAT kept or replaced
    /// the client's source.
    pub fn start_reporting_peer(netns: &NetNs, name: &str, addrs: &[SocketAddr]) -> Result<Self, NetnsError> {
        Self::serve(netns, name, addrs, true)
    }

    fn serve(netns: &NetNs, name: &str, addrs: &[SocketAddr], report_peer: bool) -> Result<Self, NetnsError> {
        let bind_addrs = addrs.to_vec();
        let bound = netns.in_ns(move || -> std::io::Result<_> {
            let mut sockets = Vec::new();
            for addr in &bind_addrs {
                let tcp = std::net::TcpListener::bind(addr)?;
                tcp.set_nonblocking(true)?;
                let udp = UdpSocket::bind(addr)?;
                udp.set_nonblocking(true)?;
                sockets.push((tcp, udp));
            }
            Ok(sockets)
        })?;
        let sockets = bound.map_err(|source| NetnsError::Io {
            context: format!("binding the name server {name} at {addrs:?} in {}", netns.name()),
            source,
        })?;
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        let name = name.to_string();
        let thread = std::thread::Builder::new()
            .name(format!("name-server-{name}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the name server");
                runtime.block_on(async move {
                    for (tcp, udp) in sockets {
                        let tcp = tokio::net::TcpListener::from_std(tcp).expect("a tokio TCP listener");
                        let udp = tokio::net::UdpSocket::from_std(udp).expect("a tokio UDP socket");
                        tokio::spawn(serve_tcp(tcp, name.clone(), report_peer));
                        tokio::spawn(serve_udp(udp, name.clone()));
                    }
                    let _ = stopped.await;
                });
            })
            .map_err(|source| NetnsError::Io {
                context: "spawning the name server's thread".into(),
                source,
            })?;
        Ok(Self {
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }
}

impl Drop for NameServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve_tcp(listener: tokio::net::TcpListener, name: String, report_peer: bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    while let Ok((mut stream, peer)) = listener.accept().await {
        let answer = if report_peer {
            format!("{name} {}\n", peer.ip().to_canonical())
        } else {
            format!("{name}\n")
        };
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 || stream.write_all(answer.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
    }
}

async fn serve_udp(socket: tokio::net::UdpSocket, name: String) {
    let mut buf = [0u8; 2048];
    while let Ok((n, from)) = socket.recv_from(&mut buf).await {
        let mut answer = format!("{name} ").into_bytes();
        answer.extend_from_slice(&buf[..n]);
        let _ = socket.send_to(&answer, from).await;
    }
}

/// Writes `?` and reads one `<name>\n` answer.
fn ask(stream: &mut TcpStream) -> std::io::Result<String> {
    stream.write_all(b"?")?;
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte)? {
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the connection closed after {:?}", String::from_utf8_lossy(&answer)),
                ));
            }
            _ if byte[0] == b'\n' => return Ok(String::from_utf8_lossy(&answer).into_owned()),
            _ => answer.push(byte[0]),
        }
    }
}

/// An answer of a [`NameServer::start_reporting_peer`] server: the name
/// and the client address it saw (`None` when the answer has none).
pub fn name_and_peer(answer: &str) -> Option<(&str, std::net::IpAddr)> {
    let (name, peer) = answer.split_once(' ')?;
    Some((name, peer.parse().ok()?))
}

/// `count` new connections from `netns` to `dst` ([`ask_names`]) to
/// [`NameServer::start_reporting_peer`] servers, by the server that
/// answered, with the client address each saw; panics on a failed
/// connection or an answer without an address.
pub fn peers_by_server(
    netns: &NetNs,
    dst: SocketAddr,
    count: usize,
    timeout: Duration,
) -> std::collections::BTreeMap<String, Vec<std::net::IpAddr>> {
    let mut by_server: std::collections::BTreeMap<String, Vec<std::net::IpAddr>> = Default::default();
    for answer in ask_names(netns, dst, count, timeout) {
        let answer = answer.unwrap_or_else(|e| panic!("asking {dst}: {e}"));
        let (name, peer) = name_and_peer(&answer).unwrap_or_else(|| panic!("answer from {dst}: {answer:?}"));
        by_server.entry(name.to_owned()).or_default().push(peer);
    }
    by_server
}

/// One new TCP connection from `netns` to `dst`: the name of the server that
/// answered, checked to come from `dst` itself (a reply not translated back
/// to a service address would never complete the handshake). A refusal is
/// `Err` of kind `ConnectionRefused`.
pub fn ask_name(netns: &NetNs, dst: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    netns
        .in_ns(move || -> std::io::Result<String> {
            let mut stream = TcpStream::connect_timeout(&dst, timeout)?;
            stream.set_read_timeout(Some(timeout))?;
            stream.set_write_timeout(Some(timeout))?;
            let peer = stream.peer_addr()?;
            if peer != dst {
                return Err(std::io::Error::other(format!("connected to {peer}, not {dst}")));
            }
            ask(&mut stream)
        })
        .map_err(std::io::Error::other)?
}

/// `count` new TCP connections from `netns` to `dst`, one after the other
/// on one thread in the namespace, each asked once as [`ask_name`] does:
/// each one's answer or error.
pub fn ask_names(netns: &NetNs, dst: SocketAddr, count: usize, timeout: Duration) -> Vec<std::io::Result<String>> {
    let asked = netns.in_ns(move || {
        (0..count)
            .map(|_| -> std::io::Result<String> {
                let mut stream = TcpStream::connect_timeout(&dst, timeout)?;
                stream.set_read_timeout(Some(timeout))?;
                stream.set_write_timeout(Some(timeout))?;
                ask(&mut stream)
            })
            .collect::<Vec<_>>()
    });
    match asked {
        Ok(answers) => answers,
        Err(e) => vec![Err(std::io::Error::other(e))],
    }
}

/// One datagram from a new socket of `netns` to `dst` (sent again every
/// 200 ms until `timeout`): the name of the server that answered, from
/// `dst` itself (the socket is connected to it). ICMP unreachable is `Err`
/// of kind `ConnectionRefused`.
pub fn ask_name_udp(netns: &NetNs, dst: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    netns
        .in_ns(move || -> std::io::Result<String> {
            let local = match dst {
                SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
                SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
            };
            let socket = UdpSocket::bind(local)?;
            socket.connect(dst)?;
            let deadline = Instant::now() + timeout;
            let mut buf = [0u8; 2048];
            while Instant::now() < deadline {
                socket.send(b"?")?;
                let left = deadline.saturating_duration_since(Instant::now());
                socket.set_read_timeout(Some(left.clamp(Duration::from_millis(1), Duration::from_millis(200))))?;
                match socket.recv(&mut buf) {
                    Ok(n) => {
                        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                        if let Some(name) = text.strip_suffix(" ?") {
                            return Ok(name.to_string());
                        }
                    }
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                    Err(e) => return Err(e),
                }
            }
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer from {dst} within {timeout:?}"),
            ))
        })
        .map_err(std::io::Error::other)?
}

/// New TCP connections from `netns`, one after the other on one thread in
/// the namespace, each `(local, dst)` bound to `local` (with `SO_REUSEADDR`)
/// and closed with a reset once connected (no TIME_WAIT on either side, so
/// a client port can come back at once, as in the services benchmark).
/// Returns how many connected, or the first failure (its index and error;
/// a lost SYN is a `TimedOut` after `timeout`).
pub fn connect_and_reset(
    netns: &NetNs,
    connections: Vec<(SocketAddr, SocketAddr)>,
    timeout: Duration,
) -> Result<usize, (usize, std::io::Error)> {
    let made = netns.in_ns(move || -> Result<usize, (usize, std::io::Error)> {
        for (i, (local, dst)) in connections.iter().enumerate() {
            let failed = |e: std::io::Error| (i, std::io::Error::new(e.kind(), format!("{local} -> {dst}: {e}")));
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(*dst),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )
            .map_err(failed)?;
            socket.set_reuse_address(true).map_err(failed)?;
            socket.set_linger(Some(Duration::ZERO)).map_err(failed)?;
            socket.bind(&(*local).into()).map_err(failed)?;
            socket.connect_timeout(&(*dst).into(), timeout).map_err(failed)?;
        }
        Ok(connections.len())
    });
    made.map_err(|e| (0, std::io::Error::other(e)))?
}

/// A TCP connection made in a pod and kept open, asked for the name of its
/// server whenever the test wants (e.g. before and after a change).
pub struct HeldConnection {
    stream: TcpStream,
    /// The server that answered first.
    pub first: String,
}

impl HeldConnection {
    /// Connects from `netns` to `dst` and asks once.
    pub fn open(netns: &NetNs, dst: SocketAddr, timeout: Duration) -> std::io::Result<Self> {
        let mut stream = netns.tcp_stream(dst, timeout).map_err(std::io::Error::other)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let first = ask(&mut stream)?;
        Ok(Self { stream, first })
    }

    /// [`open`](Self::open) from local address `local` (bound before the
    /// connect, with `SO_REUSEADDR`, so several connections to different
    /// destinations can share one client port).
    pub fn open_from(netns: &NetNs, local: SocketAddr, dst: SocketAddr, timeout: Duration) -> std::io::Result<Self> {
        let connected = netns.in_ns(move || -> std::io::Result<TcpStream> {
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(dst),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            socket.set_reuse_address(true)?;
            socket.bind(&local.into())?;
            socket.connect_timeout(&dst.into(), timeout)?;
            Ok(socket.into())
        });
        let mut stream = connected
            .map_err(std::io::Error::other)?
            .map_err(|e| std::io::Error::new(e.kind(), format!("connecting {local} to {dst}: {e}")))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let first = ask(&mut stream)?;
        Ok(Self { stream, first })
    }

    /// The connection's peer address, as its socket sees it.
    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.stream.peer_addr()
    }

    /// Asks again on the same connection.
    pub fn ask(&mut self) -> std::io::Result<String> {
        ask(&mut self.stream)
    }
}

/// What a [`UdpStream`] saw.
#[derive(Debug, Default, Clone)]
pub struct UdpTotals {
    /// Datagrams sent.
    pub sent: u64,
    /// Answers received (each to its own datagram).
    pub received: u64,
    /// The servers that answered, each once.
    pub servers: std::collections::BTreeSet<String>,
}

impl UdpTotals {
    /// Datagrams without an answer within [`UDP_ANSWER_TIMEOUT`].
    pub fn lost(&self) -> u64 {
        self.sent - self.received
    }
}

/// Datagrams from one socket of a pod to a service address, each sent
/// once the previous one was answered (or after [`UDP_ANSWER_TIMEOUT`]),
/// in a background thread: one flow, counted. Stops on drop.
pub struct UdpStream {
    stop: Arc<AtomicBool>,
    totals: Arc<(Mutex<UdpTotals>, Condvar)>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
}

impl UdpStream {
    /// Starts sending from `netns` to `dst`.
    pub fn start(netns: &NetNs, dst: SocketAddr) -> Result<Self, NetnsError> {
        let local = match dst {
            SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
        };
        let socket = netns.udp_socket(local)?;
        let stop = Arc::new(AtomicBool::new(false));
        let totals = Arc::new((Mutex::new(UdpTotals::default()), Condvar::new()));
        let thread = {
            let (stop, totals) = (stop.clone(), totals.clone());
            std::thread::spawn(move || -> std::io::Result<()> {
                socket.connect(dst)?;
                socket.set_read_timeout(Some(UDP_ANSWER_TIMEOUT))?;
                let mut buf = [0u8; 2048];
                let mut seq: u64 = 0;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    let payload = format!("seq-{seq}");
                    socket.send(payload.as_bytes())?;
                    totals.0.lock().unwrap().sent += 1;
                    let deadline = Instant::now() + UDP_ANSWER_TIMEOUT;
                    let answered = loop {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break None;
                        }
                        socket.set_read_timeout(Some(left))?;
                        match socket.recv(&mut buf) {
                            Ok(n) => {
                                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                                // A late answer to an earlier datagram is skipped.
                                if let Some(name) = text.strip_suffix(&format!(" {payload}")) {
                                    break Some(name.to_string());
                                }
                            }
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) =>
                            {
                                break None;
                            }
                            // ICMP unreachable: counted lost; go on.
                            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break None,
                            Err(e) => return Err(e),
                        }
                    };
                    if let Some(name) = answered {
                        let mut t = totals.0.lock().unwrap();
                        t.received += 1;
                        t.servers.insert(name);
                        totals.1.notify_all();
                    }
                }
                Ok(())
            })
        };
        Ok(Self {
            stop,
            totals,
            thread: Some(thread),
        })
    }

    /// What it saw so far.
    pub fn totals(&self) -> UdpTotals {
        self.totals.0.lock().unwrap().clone()
    }

    /// Waits until `n` more answers than now came back; panics after
    /// `timeout`.
    pub fn wait_more_answers(&self, n: u64, timeout: Duration) {
        let (lock, changed) = &*self.totals;
        let mut totals = lock.lock().unwrap();
        let want = totals.received + n;
        let deadline = Instant::now() + timeout;
        while totals.received < want {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "the UDP stream got {} answers of {want} within {timeout:?}: {totals:?}",
                totals.received
            );
            totals = changed.wait_timeout(totals, left).unwrap().0;
        }
    }

    /// Stops after the datagram in flight and returns the totals.
    pub fn stop(mut self) -> UdpTotals {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            match thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("the UDP stream failed: {e}"),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        self.totals()
    }
}

impl Drop for UdpStream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
