//! kube-apiserver from the host: a TCP relay listening on 127.0.0.1 of the
//! host whose outgoing connections are made inside the control-plane
//! namespace (the socket is created by a thread that entered it), so the
//! admin kubeconfig and kubectl work from the host without any route or
//! interface outside the cluster's namespaces.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use rivet_common::testing::netns::NetNs;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::{KubeClusterError, io_err};

/// How long connecting to the target may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The relay; stops (connections closed) on drop.
#[derive(Debug)]
pub(super) struct NetnsRelay {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl NetnsRelay {
    /// Listens on a free port of the host's 127.0.0.1 and relays each
    /// connection to `target` as seen from namespace `netns` (its name).
    pub async fn start(netns: &str, target: SocketAddr) -> Result<Self, KubeClusterError> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(io_err("binding the API server relay on 127.0.0.1"))?;
        let addr = listener
            .local_addr()
            .map_err(io_err("reading the API server relay's address"))?;
        let netns = netns.to_owned();
        let accept = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                connections.spawn(relay(client, netns.clone(), target));
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(Self { addr, accept })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for NetnsRelay {
    fn drop(&mut self) {
        // Dropping the accept task drops its JoinSet, which aborts every
        // connection.
        self.accept.abort();
    }
}

/// Connects to `target` from inside `netns`, then copies both ways until
/// either side closes.
async fn relay(mut client: TcpStream, netns: String, target: SocketAddr) {
    let connected = tokio::task::spawn_blocking(move || {
        let ns = NetNs::existing(&netns).map_err(|e| std::io::Error::other(e.to_string()))?;
        ns.in_ns(move || std::net::TcpStream::connect_timeout(&target, CONNECT_TIMEOUT))
            .map_err(|e| std::io::Error::other(e.to_string()))?
    })
    .await;
    let Ok(Ok(server)) = connected else { return };
    if server.set_nonblocking(true).is_err() {
        return;
    }
    let Ok(mut server) = TcpStream::from_std(server) else {
        return;
    };
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}
