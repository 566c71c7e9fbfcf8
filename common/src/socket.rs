//! Unix socket listeners for daemons: one live instance per socket, stale
//! sockets replaced, a restrictive mode and group, and every accepted
//! connection tagged with its peer's credentials and what they may do
//! ([`crate::access`]).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::server::Connected;

use crate::access::{AccessMetrics, AccessPolicy, ConnectionSlot, Peer, PeerAccess};

/// Default mode of a daemon socket: owner and group may connect.
pub const DEFAULT_SOCKET_MODE: u32 = 0o660;

/// Default `--max-connections`: far above what a node's daemons and
/// operators open (a few per client daemon, one per CNI call in flight, 100
/// concurrent ADDs in the `cni` bench) and below the common 1024 soft limit
/// of open files, so peers without full access cannot exhaust it.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

/// How long the accept loop pauses after the kernel refused an accept for
/// lack of resources (EMFILE, ENFILE, ENOBUFS, ENOMEM): the listener stays
/// readable, and retrying at once would spin a core until a descriptor is
/// freed.
const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// Path of a daemon's socket: `<socket_dir>/<daemon>.sock`.
///
/// ```
/// use std::path::Path;
/// let p = rivet_common::socket::socket_path(Path::new("/var/run/rivet/sockets"), "svc-ipam");
/// assert_eq!(p, Path::new("/var/run/rivet/sockets/svc-ipam.sock"));
/// ```
pub fn socket_path(socket_dir: &Path, daemon: &str) -> PathBuf {
    socket_dir.join(format!("{daemon}.sock"))
}

/// Why a socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another live process owns the socket.
    #[error(
        "another instance is already serving {path} (lock {lock} is held or the socket accepts connections); stop it first"
    )]
    AlreadyRunning {
        /// The socket path.
        path: PathBuf,
        /// The lock file that guards it.
        lock: PathBuf,
    },
    /// Something that is not a socket sits at the path; we never delete it.
    #[error("{path} exists and is not a Unix socket; refusing to replace it")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// An I/O step failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// To what.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SocketError + use<> {
    let path = path.to_path_buf();
    move |source| SocketError::Io { action, path, source }
}

/// Options for [`UnixSocketListener::bind`].
#[derive(Debug, Clone)]
pub struct SocketOptions {
    /// File mode of the socket (default 0660).
    pub mode: u32,
    /// Group of the socket file (default: the daemon's primary group). The
    /// daemon must be a member to set it.
    pub group: Option<u32>,
    /// Who may call what, checked per call against the peer's credentials
    /// (SO_PEERCRED, SO_PEERGROUPS). Open by default.
    pub access: AccessPolicy,
    /// Connections held open at once beyond which a new one from a peer
    /// without full access is closed at once (counted in
    /// `rivet_socket_connections_refused_total`); peers with full access are
    /// always admitted.
    pub max_connections: usize,
}

impl Default for SocketOptions {
    fn default() -> Self {
        Self {
            mode: DEFAULT_SOCKET_MODE,
            group: None,
            access: AccessPolicy::default(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// A bound daemon socket. Holding it holds an exclusive lock on
/// `<socket>.lock`, so a second instance fails fast instead of stealing the
/// socket; dropping it removes the socket file.
///
/// ```no_run
/// # async fn run() -> Result<(), rivet_common::socket::SocketError> {
/// use rivet_common::socket::{SocketOptions, UnixSocketListener};
/// let listener = UnixSocketListener::bind("/tmp/rivet/svc-ipam.sock".as_ref(), &SocketOptions::default())?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct UnixSocketListener {
    listener: Option<UnixListener>,
    guard: SocketGuard,
    access: Arc<AccessPolicy>,
    metrics: AccessMetrics,
    max_connections: usize,
}

#[derive(Debug)]
struct SocketGuard {
    path: PathBuf,
    // Held for the lifetime of the listener: the single-instance lock.
    _lock: File,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        // We hold the lock, so the socket at this path is ours.
        let _ = fs::remove_file(&self.path);
    }
}

impl UnixSocketListener {
    /// Binds `path`: creates the parent directory, takes the instance lock,
    /// replaces a stale socket (nobody listening), refuses a live one, and sets
    /// the socket's mode. Must be called inside a tokio runtime.
    pub fn bind(path: &Path, options: &SocketOptions) -> Result<Self, SocketError> {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io_err("creating socket directory", parent))?;
        }
        let lock_path = lock_path(path);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err("opening lock file", &lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(SocketError::AlreadyRunning {
                    path: path.to_path_buf(),
                    lock: lock_path,
                });
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(io_err("locking", &lock_path)(e));
            }
        }
        match fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                // A process that does not use our lock (an older build) may
                // still be serving: never steal a socket that answers.
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(SocketError::AlreadyRunning {
                        path: path.to_path_buf(),
                        lock: lock_path,
                    });
                }
                fs::remove_file(path).map_err(io_err("removing stale socket", path))?;
            }
            Ok(_) => {
                return Err(SocketError::NotASocket {
                    path: path.to_path_buf(),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("inspecting", path)(e)),
        }
        let listener = UnixListener::bind(path).map_err(io_err("binding", path))?;
        let guard = SocketGuard {
            path: path.to_path_buf(),
            _lock: lock,
        };
        fs::set_permissions(path, fs::Permissions::from_mode(options.mode)).map_err(io_err("setting mode of", path))?;
        if let Some(gid) = options.group {
            std::os::unix::fs::chown(path, None, Some(gid))
                .map_err(io_err("setting the group (the daemon must be a member of it) of", path))?;
        }
        Ok(Self {
            listener: Some(listener),
            guard,
            access: Arc::new(options.access.clone()),
            metrics: AccessMetrics::default(),
            max_connections: options.max_connections,
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.guard.path
    }

    /// Who may call what on this socket.
    pub fn access(&self) -> Arc<AccessPolicy> {
        Arc::clone(&self.access)
    }

    /// Counters of refused calls and of connections (register them with the
    /// daemon's metrics).
    pub fn access_metrics(&self) -> &AccessMetrics {
        &self.metrics
    }

    /// Accepted connections, each tagged with its peer and what the peer may
    /// do; refusals happen per call ([`crate::access::AccessLayer`]). A peer
    /// whose credentials cannot be read may do nothing. While the socket
    /// holds `max_connections`, a new connection from a peer without full
    /// access is closed at once (its calls fail as a transport error) and
    /// counted. The socket file is removed when the returned stream is
    /// dropped.
    pub fn incoming(mut self) -> impl Stream<Item = io::Result<PeerStream>> + Send + 'static {
        let listener = self.listener.take().expect("listener is present until incoming()");
        let access = Arc::clone(&self.access);
        let metrics = self.metrics.clone();
        let limit = self.max_connections;
        let path = self.guard.path.clone();
        // Keep the guard alive as long as the stream.
        let holder = self;
        let accepted = futures::StreamExt::then(UnixListenerStream::new(listener), |conn| async move {
            if let Err(e) = &conn
                && matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                )
            {
                tracing::warn!(error = %e, "accepting a connection failed for lack of resources; pausing");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
            conn
        });
        accepted.filter_map(move |conn| {
            let _ = &holder;
            let stream = match conn {
                Ok(stream) => stream,
                Err(e) => return Some(Err(e)),
            };
            let peer = peer_access(&stream, &access, &path);
            let open = usize::try_from(metrics.connections()).unwrap_or(0);
            if open >= limit && peer.access != crate::access::Access::Full {
                metrics.connection_refused(&path, &peer.peer, limit);
                // Dropping the stream closes the connection.
                return None;
            }
            Some(Ok(PeerStream {
                stream,
                peer,
                _slot: metrics.connection_opened(),
            }))
        })
    }
}

/// An accepted connection with its peer's credentials and access.
#[derive(Debug)]
pub struct PeerStream {
    stream: UnixStream,
    peer: PeerAccess,
    _slot: ConnectionSlot,
}

/// The peer of `stream` and what `policy` lets it do.
fn peer_access(stream: &UnixStream, policy: &AccessPolicy, path: &Path) -> PeerAccess {
    match peer_of(stream) {
        Ok(peer) => PeerAccess {
            access: policy.access(&peer),
            peer,
        },
        Err(e) => {
            tracing::warn!(socket = %path.display(), error = %e, "reading the peer's credentials failed; it may call nothing");
            PeerAccess {
                peer: Peer::unknown(),
                access: crate::access::Access::Denied,
            }
        }
    }
}

impl PeerStream {
    /// The peer and what it may do.
    pub fn peer(&self) -> &PeerAccess {
        &self.peer
    }
}

/// The peer's uid, gid and pid (SO_PEERCRED) and supplementary groups (SO_PEERGROUPS).
fn peer_of(stream: &UnixStream) -> io::Result<Peer> {
    let cred = stream.peer_cred()?;
    Ok(Peer {
        uid: cred.uid(),
        gid: cred.gid(),
        pid: cred.pid(),
        groups: peer_groups(stream)?,
    })
}

fn peer_groups(stream: &UnixStream) -> io::Result<Vec<u32>> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len =
            libc::socklen_t::try_from(groups.len() * size_of::<libc::gid_t>()).unwrap_or(libc::socklen_t::MAX);
        // SAFETY: `groups` has room for `len` bytes and outlives the call; the
        // kernel writes at most `len` bytes and stores the needed size in `len`.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let count = len as usize / size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(count);
            return Ok(groups);
        }
        let err = io::Error::last_os_error();
        // ERANGE: the buffer is too small and `len` says how big it must be.
        if err.raw_os_error() == Some(libc::ERANGE) && count > groups.len() {
            groups.resize(count, 0);
            continue;
        }
        return Err(err);
    }
}

impl Connected for PeerStream {
    type ConnectInfo = PeerAccess;

    fn connect_info(&self) -> PeerAccess {
        self.peer.clone()
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The lock file beside a socket, `<socket>.lock` ([`UnixSocketListener`]
/// holds it while bound; it stays when the daemon is killed).
///
/// ```
/// use std::path::Path;
/// let p = rivet_common::socket::lock_path(Path::new("/run/rivet/svc-ipam.sock"));
/// assert_eq!(p, Path::new("/run/rivet/svc-ipam.sock.lock"));
/// ```
pub fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn second_instance_on_a_live_socket_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d/svc.sock");
        let first =
            UnixSocketListener::bind(&path, &SocketOptions::default()).expect("the first instance binds a fresh path");
        let err = UnixSocketListener::bind(&path, &SocketOptions::default())
            .expect_err("a second instance must not steal a live socket");
        assert!(matches!(err, SocketError::AlreadyRunning { .. }), "{err}");
        assert!(
            path.exists(),
            "the refused instance must leave the live socket in place"
        );
        drop(first);
        assert!(!path.exists(), "dropping the listener removes its socket");
    }

    #[tokio::test]
    async fn stale_socket_is_replaced_and_mode_is_0660() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("svc.sock");
        // A socket file nobody listens on, as left by kill -9.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let l = UnixSocketListener::bind(&path, &SocketOptions::default()).expect("a stale socket is replaced");
        let mode = fs::metadata(l.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660, "daemon sockets are owner+group only");
    }

    #[tokio::test]
    async fn live_socket_without_lock_is_not_stolen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("svc.sock");
        let _other = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let err = UnixSocketListener::bind(&path, &SocketOptions::default())
            .expect_err("a socket that accepts connections belongs to a live process");
        assert!(matches!(err, SocketError::AlreadyRunning { .. }), "{err}");
    }

    #[tokio::test]
    async fn regular_file_is_never_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("svc.sock");
        fs::write(&path, b"precious").unwrap();
        let err = UnixSocketListener::bind(&path, &SocketOptions::default())
            .expect_err("a regular file at the socket path must be refused");
        assert!(matches!(err, SocketError::NotASocket { .. }), "{err}");
        assert_eq!(fs::read(&path).unwrap(), b"precious");
    }

    #[tokio::test]
    async fn accepted_peers_carry_their_credentials_and_access() {
        use crate::access::Access;
        let dir = tempfile::tempdir().unwrap();
        let my_uid = nix::unistd::getuid().as_raw();
        let my_gid = nix::unistd::getgid().as_raw();
        let my_groups: Vec<u32> = nix::unistd::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        for (name, access, expected) in [
            (
                "other-uid",
                AccessPolicy {
                    full_uids: vec![my_uid.wrapping_add(4242)],
                    ..AccessPolicy::default()
                },
                Access::Denied,
            ),
            (
                "my-gid-read-only",
                AccessPolicy {
                    full_uids: vec![my_uid.wrapping_add(4242)],
                    read_only_gids: vec![my_gid],
                    ..AccessPolicy::default()
                },
                Access::ReadOnly,
            ),
            (
                "my-uid",
                AccessPolicy {
                    full_uids: vec![my_uid],
                    ..AccessPolicy::default()
                },
                Access::Full,
            ),
            ("open", AccessPolicy::default(), Access::Full),
        ] {
            let path = dir.path().join(format!("{name}.sock"));
            let opts = SocketOptions {
                access,
                ..SocketOptions::default()
            };
            let mut incoming = Box::pin(UnixSocketListener::bind(&path, &opts).unwrap().incoming());
            let _client = UnixStream::connect(&path).await.unwrap();
            let accepted = tokio::time::timeout(std::time::Duration::from_secs(5), incoming.next())
                .await
                .expect("every peer is accepted; refusals are per call")
                .unwrap()
                .unwrap();
            let peer = accepted.peer();
            assert_eq!(peer.access, expected, "{name}");
            assert_eq!((peer.peer.uid, peer.peer.gid), (my_uid, my_gid), "{name}");
            assert_eq!(peer.peer.pid, Some(std::process::id() as i32), "{name}");
            assert_eq!(peer.peer.groups, my_groups, "SO_PEERGROUPS: {name}");
        }
    }

    #[tokio::test]
    async fn beyond_the_connection_limit_peers_without_full_access_are_closed() {
        use tokio::io::AsyncReadExt as _;
        let dir = tempfile::tempdir().unwrap();
        let my_uid = nix::unistd::getuid().as_raw();
        let start = |name: &str, full_uids: Vec<u32>| {
            let path = dir.path().join(format!("{name}.sock"));
            let opts = SocketOptions {
                access: AccessPolicy {
                    full_uids,
                    ..AccessPolicy::default()
                },
                max_connections: 2,
                ..SocketOptions::default()
            };
            let listener = UnixSocketListener::bind(&path, &opts).unwrap();
            let metrics = listener.access_metrics().clone();
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let mut incoming = Box::pin(listener.incoming());
            let task = tokio::spawn(async move {
                while let Some(conn) = incoming.next().await {
                    if tx.send(conn.unwrap()).is_err() {
                        break;
                    }
                }
            });
            (path, metrics, rx, task)
        };
        let within = std::time::Duration::from_secs(5);

        // This process is not a full-access peer here.
        let (path, metrics, mut accepted, task) = start("limited", vec![my_uid.wrapping_add(4242)]);
        let _c1 = UnixStream::connect(&path).await.unwrap();
        let _c2 = UnixStream::connect(&path).await.unwrap();
        let a1 = tokio::time::timeout(within, accepted.recv()).await.unwrap().unwrap();
        let _a2 = tokio::time::timeout(within, accepted.recv()).await.unwrap().unwrap();
        assert_eq!(metrics.connections(), 2);
        let mut c3 = UnixStream::connect(&path).await.unwrap();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(within, c3.read(&mut buf))
            .await
            .expect("the third connection is closed at once, not left hanging");
        assert_eq!(read.unwrap(), 0, "closed without a byte");
        assert_eq!(metrics.connections_refused(), 1);
        assert_eq!(metrics.connections(), 2, "the refused one was never counted open");
        // A connection that ends gives its slot back.
        drop(a1);
        assert_eq!(metrics.connections(), 1);
        let _c4 = UnixStream::connect(&path).await.unwrap();
        let _a4 = tokio::time::timeout(within, accepted.recv())
            .await
            .expect("admitted again below the limit")
            .unwrap();
        assert_eq!(metrics.connections(), 2);
        task.abort();

        // Full-access peers are admitted whatever the count.
        let (path, metrics, mut accepted, task) = start("full", vec![my_uid]);
        let mut clients = Vec::new();
        let mut admitted = Vec::new();
        for _ in 0..4 {
            clients.push(UnixStream::connect(&path).await.unwrap());
            admitted.push(tokio::time::timeout(within, accepted.recv()).await.unwrap().unwrap());
        }
        assert_eq!((metrics.connections(), metrics.connections_refused()), (4, 0));
        task.abort();
    }

    #[tokio::test]
    async fn the_socket_group_is_set() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("svc.sock");
        // A group this process is in (as root, any group would do).
        let gid = nix::unistd::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .find(|g| *g != nix::unistd::getegid().as_raw())
            .unwrap_or(4242);
        let opts = SocketOptions {
            group: Some(gid),
            ..SocketOptions::default()
        };
        let l = UnixSocketListener::bind(&path, &opts).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::gid(&fs::metadata(l.path()).unwrap()),
            gid
        );
    }
}
