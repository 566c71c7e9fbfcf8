//! Whether an etcd member is healthy: one `GET /health` over plain
//! HTTP/1.1, for the processes that start an etcd and wait for it (the
//! test fixture `testing::etcd`, `rivet cluster up`). Not a client: daemons
//! talk to etcd through etcd-client.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One `GET /health` to `addr`, each step bounded by `timeout`: true only
/// for a 200 with `"health":"true"` (etcd says false without a leader or
/// with an alarm).
///
/// ```
/// // Nothing listens on port 1 of the loopback.
/// let addr = "127.0.0.1:1".parse().unwrap();
/// assert!(!rivet_common::etcd_probe::healthy(addr, std::time::Duration::from_millis(100)));
/// ```
pub fn healthy(addr: SocketAddr, timeout: Duration) -> bool {
    let probe = || -> std::io::Result<String> {
        let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    };
    probe().is_ok_and(|r| r.starts_with("HTTP/1.1 200") && r.contains(r#""health":"true""#))
}
