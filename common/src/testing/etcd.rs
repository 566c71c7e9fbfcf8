//! A real etcd server under test: etcd v3.6 as built by `cargo xtask install`
//! (`rivet_tools`, `~/.cache/rivet/tools/etcd-v3.6.16/bin/etcd`; Debian's 3.4
//! is too old for kube-apiserver 1.34 and every test uses the same etcd), on
//! `127.0.0.1` with free ports and a data dir on tmpfs (else the temp dir), with fast raft timings
//! (`--heartbeat-interval=10 --election-timeout=100`), so it answers within a
//! few hundred milliseconds; killed and removed on drop.
//!
//! The calls block (spawn, then poll `GET /health` every few milliseconds);
//! from async code they are short enough to call directly in a test, or use
//! `tokio::task::spawn_blocking`.
//!
//! ```no_run
//! # fn t() -> Result<(), rivet_common::testing::etcd::EtcdError> {
//! use rivet_common::testing::etcd::EtcdServer;
//!
//! let mut etcd = EtcdServer::start()?;
//! let endpoint = etcd.endpoint(); // "http://127.0.0.1:PORT", for etcd_client::Client::connect
//! etcd.stop(); // SIGKILL: an outage or crash; the data dir is kept
//! assert!(!etcd.is_healthy());
//! etcd.restart()?; // same ports, same data
//! assert_eq!(etcd.endpoint(), endpoint);
//! # Ok(()) }
//! ```

use std::fs::OpenOptions;
use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rivet_tools::Tool;

use super::{last_lines, read_log};

/// How long [`EtcdServer::start`] and [`EtcdServer::restart`] wait for `/health`.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How often readiness is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(5);
/// Timeout of one health probe (connect, write, read).
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// Retries, with new ports, when a port turns out to be taken.
const PORT_RETRIES: u32 = 3;
/// Lines of the log quoted in errors.
const LOG_TAIL_LINES: usize = 40;

/// Makes names and directories unique within this process.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// What went wrong with the etcd under test; every message says what was being
/// done. `Debug` prints the message too, so `.expect(..)` and tests returning
/// `Result` show the install hint or etcd's log tail verbatim.
#[derive(thiserror::Error)]
pub enum EtcdError {
    /// The built etcd is not installed (the message names its version and
    /// `cargo xtask install`).
    #[error("starting etcd: {0}")]
    NotInstalled(#[from] rivet_tools::ToolError),
    /// A file or process operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The process exited before it was healthy.
    #[error("{action}: etcd exited with {status} before it was healthy; the tail of {log}:\n{tail}")]
    Exited {
        action: &'static str,
        status: ExitStatus,
        log: PathBuf,
        tail: String,
    },
    /// The process kept running but did not report healthy in time.
    #[error(
        "{action}: etcd did not answer GET {endpoint}/health with health true within {timeout:?}; the tail of {log}:\n{tail}"
    )]
    Timeout {
        action: &'static str,
        endpoint: String,
        timeout: Duration,
        log: PathBuf,
        tail: String,
    },
}

impl std::fmt::Debug for EtcdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Runs `f` on tokio's blocking pool; a panic in it is resumed here.
async fn on_blocking_pool<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> EtcdError {
    let context = context.into();
    move |source| EtcdError::Io { context, source }
}

/// A real etcd server (v3.6, from `cargo xtask install`) on
/// 127.0.0.1 with free client and peer ports and a temp data dir; killed
/// (SIGKILL) and its data dir removed on drop.
///
/// ```no_run
/// # fn t() -> Result<(), rivet_common::testing::etcd::EtcdError> {
/// let etcd = rivet_common::testing::etcd::EtcdServer::start()?;
/// let mut cmd = std::process::Command::new("svc-identity");
/// cmd.arg("--etcd-endpoints").arg(etcd.endpoint());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EtcdServer {
    /// The etcd binary.
    bin: PathBuf,
    /// The member name, unique per server.
    name: String,
    /// Temp dir holding `data/` and `etcd.log`; removed on drop.
    root: PathBuf,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// Creates the dir a test etcd keeps its data and log in: on tmpfs
/// (`/dev/shm`) where it can, so that a member's fsyncs do not wait behind
/// the disk traffic of a parallel build (etcd's request timeouts were seen
/// at load 37 on disk), else in the temp dir. Either way the data outlives
/// [`EtcdServer::stop`] for a restart.
fn create_root(name: &str) -> Result<PathBuf, EtcdError> {
    let shm = Path::new("/dev/shm").join(name);
    if std::fs::create_dir_all(&shm).is_ok() {
        return Ok(shm);
    }
    let root = std::env::temp_dir().join(name);
    std::fs::create_dir_all(&root).map_err(io_err(format!("creating etcd's temp dir {}", root.display())))?;
    Ok(root)
}

/// The keys under `prefix` now and a watch of every change after that
/// listing (from its revision + 1): a test follows etcd's history from here.
///
/// # Errors
/// etcd's error for the listing or the watch.
pub async fn watch_from_listing(
    client: &mut etcd_client::Client,
    prefix: &str,
) -> Result<(etcd_client::WatchStream, std::collections::BTreeSet<String>), etcd_client::Error> {
    let listing = client
        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await?;
    let revision = listing.header().map_or(0, |h| h.revision());
    let keys = listing
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect();
    let stream = client
        .watch(
            prefix,
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        )
        .await?;
    Ok((stream, keys))
}

impl EtcdServer {
    /// Starts a single-member etcd and waits until `GET /health` says
    /// `{"health":"true"}` (10 s at most). A port taken between choosing and
    /// binding it is retried with new ports (3 times).
    ///
    /// # Errors
    /// [`EtcdError::NotInstalled`] without the built etcd (before any port or
    /// directory is taken); [`EtcdError::Exited`] or
    /// [`EtcdError::Timeout`], quoting the tail of etcd's log, when it does not
    /// come up.
    pub fn start() -> Result<Self, EtcdError> {
        let bin = rivet_tools::tool_path(Tool::Etcd)?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!("rivet-etcd-{}-{id}-{nanos:08x}", std::process::id());
        let root = create_root(&name)?;
        let mut server = Self {
            bin,
            name,
            root,
            client_port: 0,
            peer_port: 0,
            child: None,
        };
        let mut attempt = 0;
        loop {
            (server.client_port, server.peer_port) = free_port_pair()?;
            match server.launch("starting etcd") {
                Err(EtcdError::Exited { ref tail, .. }) if attempt < PORT_RETRIES && port_taken(tail) => {
                    attempt += 1;
                    // Nothing is written before the listeners bind, but begin
                    // the next attempt from an empty data dir regardless.
                    let data = server.data_dir();
                    let _ = std::fs::remove_dir_all(&data);
                    server.note(&format!(
                        "port taken, retrying with new ports (retry {attempt} of {PORT_RETRIES})"
                    ));
                }
                Err(err) => return Err(err), // `server` drops: dir removed.
                Ok(()) => return Ok(server),
            }
        }
    }

    /// [`start`](Self::start) on tokio's blocking pool: the test's runtime
    /// keeps running its other tasks (clients, backends under test) while
    /// etcd comes up.
    ///
    /// ```no_run
    /// # async fn t() -> Result<(), rivet_common::testing::etcd::EtcdError> {
    /// use rivet_common::testing::etcd::EtcdServer;
    ///
    /// let etcd = EtcdServer::start_async().await?;
    /// let etcd = etcd.stop_async().await; // an outage
    /// let etcd = etcd.restart_async().await?; // back, same endpoint and data
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub async fn start_async() -> Result<Self, EtcdError> {
        on_blocking_pool(Self::start).await
    }

    /// [`stop`](Self::stop) on tokio's blocking pool; hands the server back.
    pub async fn stop_async(mut self) -> Self {
        on_blocking_pool(move || {
            self.stop();
            self
        })
        .await
    }

    /// [`restart`](Self::restart) on tokio's blocking pool; hands the server
    /// back (on an error it is dropped: killed, its temp dir removed).
    ///
    /// # Errors
    /// As [`restart`](Self::restart).
    pub async fn restart_async(mut self) -> Result<Self, EtcdError> {
        on_blocking_pool(move || self.restart().map(|()| self)).await
    }

    /// `http://127.0.0.1:PORT`, the client URL (the same across restarts).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The client address.
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.client_port))
    }

    /// etcd's `--data-dir` (kept by [`stop`](Self::stop), removed on drop).
    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    /// SIGKILLs etcd and reaps it: a crash or outage. The data dir is kept
    /// for [`restart`](Self::restart). Does nothing when it is not running.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Err only when it already exited; `wait` reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
            self.note("stopped (SIGKILL)");
        }
    }

    /// Starts etcd again on the same ports and data dir (stopping it first if
    /// it runs) and waits until it is healthy.
    ///
    /// # Errors
    /// As [`start`](Self::start); a port taken meanwhile is retried for a
    /// short while (the ports cannot change).
    pub fn restart(&mut self) -> Result<(), EtcdError> {
        self.stop();
        let mut attempt = 0;
        loop {
            match self.launch("restarting etcd") {
                Err(EtcdError::Exited { ref tail, .. }) if attempt < PORT_RETRIES && port_taken(tail) => {
                    attempt += 1;
                    self.note(&format!("port taken, retrying (retry {attempt} of {PORT_RETRIES})"));
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => return other,
            }
        }
    }

    /// etcd's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Everything etcd wrote to stdout and stderr, across restarts, with a
    /// `=== rivet: ... ===` line for each start, stop and retry.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// One `GET /health` probe: true when etcd answers `{"health":"true"}`.
    pub fn is_healthy(&self) -> bool {
        health_probe(self.client_addr())
    }

    fn log_path(&self) -> PathBuf {
        self.root.join("etcd.log")
    }

    /// Appends a marker line to the log (best effort).
    fn note(&self, what: &str) {
        if let Ok(mut log) = OpenOptions::new().create(true).append(true).open(self.log_path()) {
            let _ = writeln!(log, "=== rivet: {} {what} ===", self.name);
        }
    }

    /// Spawns etcd with the current ports and waits until it is healthy.
    fn launch(&mut self, action: &'static str) -> Result<(), EtcdError> {
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        self.note(&format!("{action}: client {client_url}, peer {peer_url}"));
        let log = self.log_path();
        let stdout = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(io_err(format!("{action}: opening the log {}", log.display())))?;
        let stderr = stdout
            .try_clone()
            .map_err(io_err(format!("{action}: duplicating the log file {}", log.display())))?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--name")
            .arg(&self.name)
            .arg("--data-dir")
            .arg(self.data_dir())
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("{}={peer_url}", self.name))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--heartbeat-interval=10")
            .arg("--election-timeout=100")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        if let Some(arch) = unsupported_arch() {
            cmd.env("ETCD_UNSUPPORTED_ARCH", arch);
        }
        let child = cmd
            .spawn()
            .map_err(io_err(format!("{action}: spawning {}", self.bin.display())))?;
        let child = self.child.insert(child);
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.client_port));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = child
                .try_wait()
                .map_err(io_err(format!("{action}: checking on etcd (pid {})", child.id())))?
            {
                self.child = None;
                return Err(EtcdError::Exited {
                    action,
                    status,
                    tail: last_lines(&read_log(&log), LOG_TAIL_LINES),
                    log,
                });
            }
            if health_probe(addr) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(EtcdError::Timeout {
                    action,
                    endpoint: self.endpoint(),
                    timeout: READY_TIMEOUT,
                    tail: last_lines(&read_log(&log), LOG_TAIL_LINES),
                    log,
                });
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Two distinct free ports: both bound at once, then released for etcd.
fn free_port_pair() -> Result<(u16, u16), EtcdError> {
    let bind = || {
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| Ok((l.local_addr()?.port(), l)))
            .map_err(io_err("choosing a free port for etcd (binding 127.0.0.1:0)"))
    };
    let (client, _client) = bind()?;
    let (peer, _peer) = bind()?;
    Ok((client, peer))
}

/// Whether etcd's log says a listener could not bind.
fn port_taken(log_tail: &str) -> bool {
    log_tail.contains("address already in use")
}

/// `ETCD_UNSUPPORTED_ARCH` for architectures etcd 3.6 does not support
/// officially (amd64, arm64, ppc64le, s390x); `None` where it is not needed.
fn unsupported_arch() -> Option<&'static str> {
    match std::env::consts::ARCH {
        "x86_64" | "aarch64" | "powerpc64" | "s390x" => None,
        "x86" => Some("386"),
        other => Some(other),
    }
}

/// `GET /health`: true only for a 200 with `"health":"true"`.
fn health_probe(addr: SocketAddr) -> bool {
    crate::etcd_probe::healthy(addr, PROBE_TIMEOUT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;
    use std::net::TcpStream;

    /// Standard base64 with padding (etcd's JSON gateway encodes bytes so).
    fn b64(bytes: &[u8]) -> String {
        const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    fn unb64(text: &str) -> Vec<u8> {
        let value = |c: u8| match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {text:?}"),
        };
        let digits: Vec<u32> = text.bytes().filter(|&c| c != b'=').map(value).collect();
        let mut out = Vec::new();
        for chunk in digits.chunks(4) {
            let n = chunk.iter().enumerate().fold(0, |n, (i, d)| n | (d << (18 - 6 * i)));
            out.extend(n.to_be_bytes()[1..chunk.len()].iter());
        }
        out
    }

    /// POSTs JSON to etcd's v3 HTTP gateway; returns the parsed JSON body.
    fn post(etcd: &EtcdServer, path: &str, body: &serde_json::Value) -> serde_json::Value {
        let body = body.to_string();
        let mut stream = TcpStream::connect(etcd.client_addr()).expect("connect to etcd");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        write!(
            stream,
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .expect("write the request");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read the response");
        let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
        assert!(head.starts_with("HTTP/1.1 200"), "POST {path}: {response}");
        assert!(
            !head.to_ascii_lowercase().contains("transfer-encoding: chunked"),
            "{head}"
        );
        serde_json::from_str(body).unwrap_or_else(|err| panic!("POST {path}: {err}: {body}"))
    }

    fn put(etcd: &EtcdServer, key: &str, value: &str) {
        post(
            etcd,
            "/v3/kv/put",
            &serde_json::json!({"key": b64(key.as_bytes()), "value": b64(value.as_bytes())}),
        );
    }

    fn get(etcd: &EtcdServer, key: &str) -> Option<String> {
        let reply = post(etcd, "/v3/kv/range", &serde_json::json!({"key": b64(key.as_bytes())}));
        let value = reply["kvs"].get(0)?["value"].as_str().expect("a base64 value");
        Some(String::from_utf8(unb64(value)).expect("UTF-8"))
    }

    fn pid_alive(pid: u32) -> bool {
        // A reaped process has no /proc entry (a zombie would still have one).
        std::path::Path::new(&format!("/proc/{pid}")).exists()
    }

    #[test]
    fn etcd_base64_round_trips() {
        assert_eq!(b64(b""), "");
        assert_eq!(b64(b"f"), "Zg==");
        assert_eq!(b64(b"fo"), "Zm8=");
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"foob"), "Zm9vYg==");
        for text in ["", "f", "fo", "foo", "foob", "fooba", "foobar", "identity/v1/id/256"] {
            assert_eq!(unb64(&b64(text.as_bytes())), text.as_bytes(), "{text}");
        }
    }

    #[test]
    fn etcd_tail_keeps_the_last_lines() {
        assert_eq!(last_lines("a\nb\nc\n", 2), "b\nc");
        assert_eq!(last_lines("a", 5), "a");
        assert_eq!(last_lines("", 5), "");
    }

    #[test]
    fn etcd_two_servers_stop_restart_and_drop() {
        let started = Instant::now();
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(EtcdServer::start);
            let b = s.spawn(EtcdServer::start);
            (a.join().expect("thread a"), b.join().expect("thread b"))
        });
        let (mut a, b) = (a.expect("start etcd a"), b.expect("start etcd b"));
        eprintln!("two etcd servers started in parallel in {:?}", started.elapsed());

        assert_ne!(a.endpoint(), b.endpoint());
        assert_eq!(a.client_addr().port(), a.client_port);
        let ports = [a.client_port, a.peer_port, b.client_port, b.peer_port];
        assert!(
            ports.iter().all(|&p| ports.iter().filter(|&&q| q == p).count() == 1),
            "{ports:?}"
        );
        assert!(a.endpoint().starts_with("http://127.0.0.1:"), "{}", a.endpoint());
        assert!(a.is_healthy() && b.is_healthy());
        assert_ne!(a.data_dir(), b.data_dir());

        // Really etcd: write on a, read back on a; b is a separate cluster.
        put(&a, "rivet/test/key", "value-a");
        put(&b, "rivet/test/key", "value-b");
        assert_eq!(get(&a, "rivet/test/key").as_deref(), Some("value-a"));
        assert_eq!(get(&b, "rivet/test/key").as_deref(), Some("value-b"));
        assert_eq!(get(&a, "rivet/test/absent"), None);

        // Outage: killed, down, data kept.
        let endpoint = a.endpoint();
        let pid = a.pid().expect("a runs");
        a.stop();
        assert_eq!(a.pid(), None);
        assert!(!pid_alive(pid), "etcd pid {pid} still exists after stop");
        assert!(!a.is_healthy(), "etcd answers /health after stop");
        assert!(a.data_dir().join("member").is_dir(), "data dir gone after stop");
        assert!(b.is_healthy(), "stopping a affected b");

        let restarted = Instant::now();
        a.restart().expect("restart etcd a");
        eprintln!("etcd restarted in {:?}", restarted.elapsed());
        assert_eq!(a.endpoint(), endpoint);
        assert_ne!(a.pid(), Some(pid));
        assert!(a.is_healthy());
        assert_eq!(
            get(&a, "rivet/test/key").as_deref(),
            Some("value-a"),
            "the key did not survive"
        );
        put(&a, "rivet/test/key", "value-a2");
        assert_eq!(get(&a, "rivet/test/key").as_deref(), Some("value-a2"));
        let log = a.log();
        assert!(
            log.contains("stopped (SIGKILL)") && log.contains("restarting etcd"),
            "{log}"
        );

        // Drop: process gone, temp dir removed.
        for server in [a, b] {
            let pid = server.pid().expect("runs");
            let root = server.root.clone();
            assert!(root.is_dir());
            drop(server);
            assert!(!pid_alive(pid), "etcd pid {pid} still exists after drop");
            assert!(!root.exists(), "{} still exists after drop", root.display());
        }
    }

    /// The async forms hand the same server back: stopped, then restarted
    /// on its endpoint with its data.
    #[tokio::test]
    async fn etcd_async_start_stop_restart_keep_the_server() {
        let etcd = EtcdServer::start_async().await.expect("start etcd");
        put(&etcd, "rivet/test/key", "kept");
        let endpoint = etcd.endpoint();
        let etcd = etcd.stop_async().await;
        assert_eq!(etcd.pid(), None);
        assert!(!etcd.is_healthy(), "etcd answers /health after stop_async");
        let etcd = etcd.restart_async().await.expect("restart etcd");
        assert_eq!(etcd.endpoint(), endpoint);
        assert_eq!(get(&etcd, "rivet/test/key").as_deref(), Some("kept"));
    }

    /// etcd-client 0.21 against the harness: put/get and a create-if-absent
    /// compare-and-swap (the identity allocator's primitive) that only the
    /// first of two attempts wins.
    #[tokio::test]
    async fn etcd_client_put_get_and_create_if_absent() {
        use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};

        let etcd = EtcdServer::start().expect("start etcd");
        let mut client = Client::connect([etcd.endpoint()], None).await.expect("connect");

        client.put("rivet/test/k", "v1", None).await.expect("put");
        let got = client.get("rivet/test/k", None).await.expect("get");
        assert_eq!(got.kvs().len(), 1);
        assert_eq!(got.kvs()[0].value(), b"v1");

        let key = "rivet/test/id/256";
        let create = |labels: &str| {
            Txn::new()
                .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key, labels, None)])
                .or_else([TxnOp::get(key, None)])
        };
        let first = client.txn(create("k8s:app=a")).await.expect("first txn");
        assert!(first.succeeded(), "the first create-if-absent must win");
        let second = client.txn(create("k8s:app=b")).await.expect("second txn");
        assert!(!second.succeeded(), "the second create-if-absent must fail");
        let got = client.get(key, None).await.expect("get");
        assert_eq!(got.kvs()[0].value(), b"k8s:app=a", "the loser overwrote the winner");
    }

    #[test]
    fn etcd_failed_restart_quotes_the_log() {
        let mut etcd = EtcdServer::start().expect("start etcd");
        etcd.stop();
        // A file where the data dir should be: etcd exits at once.
        std::fs::remove_dir_all(etcd.data_dir()).expect("remove the data dir");
        std::fs::write(etcd.data_dir(), "not a directory").expect("write a file");
        let err = etcd.restart().expect_err("etcd cannot start on a file");
        let message = err.to_string();
        assert!(matches!(err, EtcdError::Exited { .. }), "{message}");
        assert!(message.starts_with("restarting etcd: etcd exited with"), "{message}");
        // etcd 3.6 logs JSON; its fatal line says why.
        assert!(
            message.contains(r#""level":"fatal""#) && message.contains("not a directory"),
            "no log tail in: {message}"
        );
        assert_eq!(etcd.pid(), None);
        assert!(!etcd.is_healthy());
    }

    /// Without the built etcd, start fails at once naming the version and
    /// the install command (no test silently skips).
    #[test]
    fn etcd_missing_binary_names_the_version_and_the_install() {
        let empty = tempfile::tempdir().expect("temp dir");
        let err = rivet_tools::ToolsDir::at(empty.path())
            .path(Tool::Etcd)
            .map_err(EtcdError::from)
            .expect_err("no etcd in an empty cache");
        let message = err.to_string();
        assert!(
            message.starts_with("starting etcd: etcd (etcd v3.6.16) is not installed"),
            "{message}"
        );
        assert!(message.contains("run `cargo xtask install`"), "{message}");
    }

    /// The server under test is the built etcd 3.6, not whatever `etcd` is
    /// in PATH (Debian's 3.4 is too old for kube-apiserver 1.34).
    #[test]
    fn etcd_is_the_built_3_6() {
        let etcd = EtcdServer::start().expect("start etcd");
        let mut stream = TcpStream::connect(etcd.client_addr()).expect("connect to etcd");
        stream
            .write_all(b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .expect("write the request");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read the response");
        assert!(response.contains(r#""etcdserver":"3.6."#), "{response}");
    }
}
