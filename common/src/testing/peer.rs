//! Connecting to a daemon's socket as another user, without a helper
//! process: a short-lived thread switches its own credentials with the raw
//! `setgroups`/`setresgid`/`setresuid` system calls (glibc's wrappers would
//! switch every thread of the test), connects, and ends. The kernel records
//! the connecting thread's credentials as the peer's (SO_PEERCRED,
//! SO_PEERGROUPS), so the daemon sees that user for the connection's
//! lifetime; the test process keeps its own. Root is required.
//!
//! ```no_run
//! # async fn t() -> std::io::Result<()> {
//! use rivet_common::testing::peer::{Credentials, channel_as};
//! let nobody = Credentials { uid: 65534, gid: 65534, groups: vec![] };
//! let channel = channel_as("/run/rivet/sockets/svc-ipam.sock".as_ref(), &nobody).await?;
//! # Ok(()) }
//! ```

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// Who a connection claims to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its supplementary groups.
    pub groups: Vec<u32>,
}

impl Credentials {
    /// `nobody:nogroup` (65534) with no supplementary group.
    pub fn nobody() -> Self {
        Self {
            uid: 65534,
            gid: 65534,
            groups: Vec::new(),
        }
    }
}

/// A blocking connection to `path` made as `who` (see the module docs).
pub fn connect_as(path: &Path, who: &Credentials) -> io::Result<UnixStream> {
    let path = path.to_path_buf();
    let who = who.clone();
    std::thread::Builder::new()
        .name("connect-as".into())
        .spawn(move || {
            // SAFETY: raw system calls on this thread's own credentials, with
            // a valid pointer and length for the group list; the thread ends
            // right after, so no other code runs under them.
            unsafe {
                let groups: Vec<libc::gid_t> = who.groups.clone();
                let (uid, gid) = (libc::c_long::from(who.uid), libc::c_long::from(who.gid));
                if libc::syscall(libc::SYS_setgroups, groups.len() as libc::c_long, groups.as_ptr()) != 0
                    || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
                    || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            UnixStream::connect(&path)
        })?
        .join()
        .map_err(|_| io::Error::other("the connecting thread panicked"))?
}

/// A gRPC channel over one connection to `path` made as `who`; calls on it
/// reach the daemon as that user. Must be called inside a tokio runtime.
pub async fn channel_as(path: &Path, who: &Credentials) -> io::Result<Channel> {
    let stream = connect_as(path, who)?;
    stream.set_nonblocking(true)?;
    channel_over(tokio::net::UnixStream::from_std(stream)?, path).await
}

/// A gRPC channel over an already connected `stream` (to `path`, named in
/// errors only). It does not reconnect: once the connection is gone its
/// calls fail.
pub async fn channel_over(stream: tokio::net::UnixStream, path: &Path) -> io::Result<Channel> {
    let slot = Arc::new(Mutex::new(Some(stream)));
    let path: PathBuf = path.to_path_buf();
    let connector = tower::service_fn(move |_: http::Uri| {
        let taken = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        async move {
            taken
                .map(TokioIo::new)
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "the one connection is used up"))
        }
    });
    Endpoint::from_static("http://rivet.invalid")
        .connect_with_connector(connector)
        .await
        .map_err(|e| io::Error::other(format!("an HTTP/2 connection over {}: {e}", path.display())))
}
