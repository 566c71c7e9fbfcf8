//! Socket-level load balancing (rivet.h "socket load balancing"): the
//! `lb_sock_rev` map, where the cgroup programs remember what a socket's VIP
//! was translated to, so that `getpeername` and `recvmsg` show the VIP.

use std::net::SocketAddr;

use super::{ip_to_raw, socket_from_raw};

/// `struct lb_sock_rev_key`: a socket (its cookie) and the backend it was
/// sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbSockRevKey {
    /// The socket's cookie (`bpf_get_socket_cookie`, `SO_COOKIE`).
    pub cookie: u64,
    /// The backend's address (network order; IPv4 in `addr[0]`).
    pub addr: [u32; 4],
    /// The backend's port (network order).
    pub port: u16,
    /// 4 or 6.
    pub family: u8,
    /// Zero.
    pub pad: [u8; 5],
}

impl LbSockRevKey {
    /// The key of socket `cookie` sent to `backend`.
    pub fn new(cookie: u64, backend: SocketAddr) -> Self {
        let (family, addr) = ip_to_raw(backend.ip());
        Self {
            cookie,
            addr,
            port: backend.port().to_be(),
            family,
            pad: [0; 5],
        }
    }

    /// The backend.
    pub fn backend(&self) -> Option<SocketAddr> {
        socket_from_raw(self.family, self.addr, self.port)
    }
}

/// [`LbSockRev::flags`]: written per datagram by sendmsg (unconnected
/// UDP); svc-gc ages these by [`LbSockRev::last_used`]. Entries without it
/// (connect: TCP, connected UDP) are left to the LRU.
pub const LB_SOCK_REV_F_DATAGRAM: u8 = 1 << 0;

/// `struct lb_sock_rev`: the frontend (VIP and port) a socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbSockRev {
    /// The VIP (network order; IPv4 in `addr[0]`).
    pub addr: [u32; 4],
    /// The VIP's port (network order).
    pub port: u16,
    /// 4 or 6.
    pub family: u8,
    /// `LB_SOCK_REV_F_*` (0 in entries of datapaths before it: padding).
    pub flags: u8,
    /// Seconds of the kernel's monotonic clock at the entry's last use
    /// (the service id in entries of older datapaths, which have no
    /// [`LB_SOCK_REV_F_DATAGRAM`] and are never aged).
    pub last_used: u32,
}

impl LbSockRev {
    /// The VIP and port.
    pub fn frontend(&self) -> Option<SocketAddr> {
        socket_from_raw(self.family, self.addr, self.port)
    }
}

// SAFETY: #[repr(C)], integers and integer arrays only, explicit padding
// (checked by the layout tests in `maps`): any bit pattern is valid.
unsafe impl aya::Pod for LbSockRevKey {}
unsafe impl aya::Pod for LbSockRev {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_keeps_the_backend_in_network_order() {
        let backend: SocketAddr = "[2001:2::5]:8080".parse().unwrap();
        let key = LbSockRevKey::new(7, backend);
        assert_eq!(key.port, 8080u16.to_be());
        assert_eq!(key.family, 6);
        assert_eq!(key.backend(), Some(backend));
        let v4: SocketAddr = "198.18.0.9:53".parse().unwrap();
        assert_eq!(LbSockRevKey::new(1, v4).backend(), Some(v4));
    }
}
