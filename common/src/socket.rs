//! Unix socket listeners for daemons: one live instance per socket, stale
//! sockets replaced, a restrictive mode, and an optional peer-UID allow list.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use futures::Stream;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;

/// Default mode of a daemon socket: owner and group may connect.
pub const DEFAULT_SOCKET_MODE: u32 = 0o660;

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
    /// When non-empty, only peers whose UID is listed may talk to the daemon
    /// (checked with SO_PEERCRED on every accepted connection).
    pub allowed_uids: Vec<u32>,
}

impl Default for SocketOptions {
    fn default() -> Self {
        Self {
            mode: DEFAULT_SOCKET_MODE,
            allowed_uids: Vec::new(),
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
    allowed_uids: Vec<u32>,
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
        Ok(Self {
            listener: Some(listener),
            guard,
            allowed_uids: options.allowed_uids.clone(),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.guard.path
    }

    /// Accepted connections, with peers outside the UID allow list dropped
    /// (and logged). The socket file is removed when the returned stream is
    /// dropped.
    pub fn incoming(mut self) -> impl Stream<Item = io::Result<UnixStream>> + Send + 'static {
        let listener = self.listener.take().expect("listener is present until incoming()");
        let allowed = std::mem::take(&mut self.allowed_uids);
        let path = self.guard.path.clone();
        // Keep the guard alive as long as the stream.
        let holder = self;
        UnixListenerStream::new(listener).filter(move |conn| {
            let _ = &holder;
            match conn {
                Ok(stream) => peer_allowed(stream, &allowed, &path),
                Err(_) => true,
            }
        })
    }
}

fn peer_allowed(stream: &UnixStream, allowed: &[u32], path: &Path) -> bool {
    if allowed.is_empty() {
        return true;
    }
    match stream.peer_cred() {
        Ok(cred) if allowed.contains(&cred.uid()) => true,
        Ok(cred) => {
            tracing::warn!(
                socket = %path.display(),
                uid = cred.uid(),
                pid = cred.pid(),
                "rejected connection from a UID outside the allow list"
            );
            false
        }
        Err(e) => {
            tracing::warn!(socket = %path.display(), error = %e, "rejected connection: SO_PEERCRED failed");
            false
        }
    }
}

fn lock_path(path: &Path) -> PathBuf {
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
    async fn peers_outside_the_uid_allow_list_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("svc.sock");
        let me = std::fs::metadata("/proc/self").unwrap();
        let my_uid = std::os::unix::fs::MetadataExt::uid(&me);
        let opts = SocketOptions {
            allowed_uids: vec![my_uid.wrapping_add(4242)],
            ..SocketOptions::default()
        };
        let listener = UnixSocketListener::bind(&path, &opts).unwrap();
        let mut incoming = Box::pin(listener.incoming());
        let _client = UnixStream::connect(&path).await.unwrap();
        let accepted = tokio::time::timeout(std::time::Duration::from_millis(300), incoming.next()).await;
        assert!(
            accepted.is_err(),
            "a peer whose UID is not allowed must never reach the server"
        );

        let dir2 = tempfile::tempdir().unwrap();
        let path2 = dir2.path().join("svc.sock");
        let opts = SocketOptions {
            allowed_uids: vec![my_uid],
            ..SocketOptions::default()
        };
        let mut incoming = Box::pin(UnixSocketListener::bind(&path2, &opts).unwrap().incoming());
        let _client = UnixStream::connect(&path2).await.unwrap();
        let accepted = tokio::time::timeout(std::time::Duration::from_secs(5), incoming.next()).await;
        assert!(matches!(accepted, Ok(Some(Ok(_)))), "an allowed UID must be accepted");
    }
}
