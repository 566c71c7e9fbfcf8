//! A TCP relay on 127.0.0.1 in front of a server, that a test can cut: a
//! network partition between one client and the server without touching
//! any interface. After [`TcpRelay::cut`] every byte in either direction is
//! dropped and connections stay open, so the client's requests hang (as
//! behind a dead link) instead of failing fast.
//!
//! ```no_run
//! # async fn t(api_server: std::net::SocketAddr) -> std::io::Result<()> {
//! let relay = rivet_testkit::relay::TcpRelay::start(api_server).await?;
//! // point the client at relay.addr(), then:
//! relay.cut();
//! # Ok(()) }
//! ```

use std::net::{Ipv4Addr, SocketAddr};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// A relay to one server; stops (connections closed) on drop.
#[derive(Debug)]
pub struct TcpRelay {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    /// The accept loop; it owns the connections' tasks, aborted with it.
    accept: tokio::task::JoinHandle<()>,
}

impl TcpRelay {
    /// Listens on a free port of 127.0.0.1 and relays each connection to
    /// `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(false);
        let accept = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                connections.spawn(relay(client, target, cut_rx.clone()));
                // Reap finished connections as we go.
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(Self { addr, cut, accept })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every byte from now on, both ways, on open and new connections.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn relay(client: TcpStream, target: SocketAddr, cut: watch::Receiver<bool>) {
    let (client_read, client_write) = client.into_split();
    if *cut.borrow() {
        // Partitioned already: swallow what the client sends.
        pump(client_read, None::<tokio::net::tcp::OwnedWriteHalf>, cut).await;
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let (server_read, server_write) = server.into_split();
    tokio::join!(
        pump(client_read, Some(server_write), cut.clone()),
        pump(server_read, Some(client_write), cut),
    );
}

/// Copies `from` to `to` until EOF, dropping the bytes once cut.
async fn pump(
    mut from: impl AsyncReadExt + Unpin,
    mut to: Option<impl AsyncWriteExt + Unpin>,
    cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if *cut.borrow() {
            continue;
        }
        if let Some(to) = to.as_mut()
            && to.write_all(&buf[..n]).await.is_err()
        {
            break;
        }
    }
    if let Some(mut to) = to
        && !*cut.borrow()
    {
        let _ = to.shutdown().await;
    }
}
