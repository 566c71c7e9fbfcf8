//! Sockets of the health endpoint's namespace for the daemon: a helper
//! process forked at start, before anything else, that enters the namespace
//! (`setns` needs CAP_SYS_ADMIN, which only the starting process has), then
//! drops its privileges exactly like the daemon (same user, no capability,
//! `no_new_privs`) and makes sockets on request, handing each over a Unix
//! socket pair (`SCM_RIGHTS`). A socket belongs to the namespace it was
//! made in, whoever uses it.
//!
//! A process, not a thread: the daemon drops its privileges while it is the
//! only thread (credentials are per thread), and a helper thread started
//! before would escape that check. The helper dies with the daemon
//! (`PR_SET_PDEATHSIG`), and a restarted daemon forks a new one.
//!
//! Tests in one (threaded) process use [`crate::net::NamespaceSockets`]
//! instead.

use std::io::{IoSlice, IoSliceMut};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use socket2::Socket;

use crate::net::{SocketKind, SocketSource};

/// Why the helper could not be started.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    /// The namespace could not be opened.
    #[error("opening the health endpoint namespace {path}: {source}")]
    Open {
        /// Its path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// The helper could not enter the namespace or drop its privileges.
    #[error("the socket helper in {path}: {message}")]
    Helper {
        /// The namespace.
        path: PathBuf,
        /// What it said.
        message: String,
    },
}

/// The daemon's side of the helper.
#[derive(Debug)]
pub struct ForkedNamespaceSockets {
    channel: Mutex<UnixDatagram>,
    namespace: PathBuf,
}

fn encode(kind: SocketKind, address: IpAddr) -> [u8; 2] {
    [
        match kind {
            SocketKind::Tcp => 0,
            SocketKind::IcmpEcho => 1,
        },
        u8::from(address.is_ipv6()),
    ]
}

fn decode(request: [u8; 2]) -> Option<(SocketKind, IpAddr)> {
    let kind = match request[0] {
        0 => SocketKind::Tcp,
        1 => SocketKind::IcmpEcho,
        _ => return None,
    };
    let address = if request[1] == 1 {
        IpAddr::from([0u16; 8])
    } else {
        IpAddr::from([0u8; 4])
    };
    Some((kind, address))
}

impl ForkedNamespaceSockets {
    /// Forks the helper into the namespace at `path`; it drops its
    /// privileges with `drop` (the daemon's own drop, run in the child).
    /// Call it first in `main`, while the process has one thread.
    pub fn fork(path: &Path, drop: impl FnOnce() -> Result<(), String>) -> Result<Self, HelperError> {
        let namespace = std::fs::File::open(path).map_err(|source| HelperError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let (ours, theirs) = UnixDatagram::pair().map_err(|source| HelperError::Sys {
            what: "making the helper's socket pair",
            source,
        })?;
        let parent = nix::unistd::getpid();
        // SAFETY: called while the process has one thread (main, before the
        // runtime starts), so the child inherits no lock held by another
        // thread; the child only makes system calls and small allocations.
        match unsafe { nix::unistd::fork() }.map_err(|e| HelperError::Sys {
            what: "forking the socket helper",
            source: e.into(),
        })? {
            nix::unistd::ForkResult::Child => {
                drop_fd(ours);
                let code = serve(&namespace, theirs, parent, drop);
                std::process::exit(code);
            }
            nix::unistd::ForkResult::Parent { .. } => {}
        }
        drop_fd(theirs);
        // The first message says whether the child got in and dropped.
        let mut status = [0u8; 512];
        let n = ours.recv(&mut status).map_err(|source| HelperError::Sys {
            what: "waiting for the socket helper",
            source,
        })?;
        if n == 0 || status[0] != 0 {
            return Err(HelperError::Helper {
                path: path.to_path_buf(),
                message: String::from_utf8_lossy(&status[1..n.max(1)]).into_owned(),
            });
        }
        Ok(Self {
            channel: Mutex::new(ours),
            namespace: path.to_path_buf(),
        })
    }
}

fn drop_fd<T>(value: T) {
    std::mem::drop(value);
}

/// The child: enter, drop, answer requests until the daemon is gone.
fn serve(
    namespace: &std::fs::File,
    channel: UnixDatagram,
    parent: nix::unistd::Pid,
    drop: impl FnOnce() -> Result<(), String>,
) -> i32 {
    let report = |result: Result<(), String>| {
        let message = match &result {
            Ok(()) => vec![0u8],
            Err(e) => std::iter::once(1u8).chain(e.bytes().take(500)).collect(),
        };
        let _ = channel.send(&message);
        result.is_ok()
    };
    // Die with the daemon: nothing else would end this process. Set after
    // the drop (a change of user clears it) and checked against a daemon
    // that died before it was set.
    let started = nix::sched::setns(namespace, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("setns(CLONE_NEWNET): {e} (needs CAP_SYS_ADMIN at start)"))
        .and_then(|()| drop())
        .and_then(|()| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(|e| format!("PR_SET_PDEATHSIG: {e}"))
        })
        .and_then(|()| {
            if nix::unistd::getppid() == parent {
                Ok(())
            } else {
                Err("the daemon ended before the helper started".to_string())
            }
        });
    if !report(started) {
        return 1;
    }
    loop {
        let mut request = [0u8; 2];
        match channel.recv(&mut request) {
            Ok(2) => {}
            // The daemon closed its end (or a malformed request): done.
            _ => return 0,
        }
        let Some((kind, address)) = decode(request) else {
            return 0;
        };
        let sent = match crate::net::new_socket(kind, address) {
            Ok(socket) => {
                let fds = [socket.as_raw_fd()];
                sendmsg::<()>(
                    channel.as_raw_fd(),
                    &[IoSlice::new(&[0])],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::empty(),
                    None,
                )
            }
            Err(e) => {
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                let mut message = vec![1u8];
                message.extend_from_slice(&errno.to_ne_bytes());
                sendmsg::<()>(
                    channel.as_raw_fd(),
                    &[IoSlice::new(&message)],
                    &[],
                    MsgFlags::empty(),
                    None,
                )
            }
        };
        if sent.is_err() {
            return 0;
        }
    }
}

fn receive_socket(channel: RawFd) -> std::io::Result<Socket> {
    let mut data = [0u8; 8];
    let mut iov = [IoSliceMut::new(&mut data)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let message = recvmsg::<()>(channel, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut received: Option<OwnedFd> = None;
    for cmsg in message.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for fd in fds {
                // SAFETY: the kernel just installed `fd` in this process for
                // us; nothing else owns it.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                if received.is_none() {
                    received = Some(owned);
                }
            }
        }
    }
    let bytes = message.bytes;
    match received {
        Some(fd) => Ok(Socket::from(fd)),
        None if bytes >= 5 && data[0] == 1 => Err(std::io::Error::from_raw_os_error(i32::from_ne_bytes([
            data[1], data[2], data[3], data[4],
        ]))),
        None => Err(std::io::Error::other("the socket helper answered without a socket")),
    }
}

impl SocketSource for ForkedNamespaceSockets {
    fn socket(&self, kind: SocketKind, address: IpAddr) -> std::io::Result<Socket> {
        // One request and its answer at a time.
        let channel = self.channel.lock().unwrap_or_else(|e| e.into_inner());
        channel.send(&encode(kind, address)).map_err(|e| {
            std::io::Error::other(format!(
                "the socket helper in {} is gone: {e}",
                self.namespace.display()
            ))
        })?;
        let socket = receive_socket(channel.as_raw_fd())?;
        socket.set_nonblocking(true)?;
        Ok(socket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for kind in [SocketKind::Tcp, SocketKind::IcmpEcho] {
            for address in [IpAddr::from([198, 18, 0, 1]), "2001:2::1".parse().unwrap()] {
                let (k, a) = decode(encode(kind, address)).unwrap();
                assert_eq!(k, kind);
                assert_eq!(a.is_ipv6(), address.is_ipv6());
            }
        }
        assert_eq!(decode([7, 0]), None);
    }
}
