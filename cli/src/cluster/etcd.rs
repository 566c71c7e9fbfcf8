//! The cluster's etcd: one etcd v3.6 member (the binary `cargo xtask
//! install` builds, or `--etcd-binary`) on 127.0.0.1 with free ports and its
//! data under the cluster dir, running in its own session so that it
//! outlives `rivet cluster up`; stopped by `rivet cluster down`, crashed
//! and started again on the same ports and data by `rivet cluster
//! restart-etcd` (what a chaos run does to it).

use std::fs::OpenOptions;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};

/// How long etcd may take to report healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Timeout of one health probe (connect, write, read).
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// The running etcd, as cluster.json records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdRecord {
    /// Its pid.
    pub pid: u32,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// Its client address.
    pub client_addr: SocketAddr,
    /// `--data-dir`.
    pub data_dir: PathBuf,
    /// stdout and stderr.
    pub log: PathBuf,
    /// Its peer address (`None` in records of older versions: a restart
    /// then picks a free port).
    #[serde(default)]
    pub peer_addr: Option<SocketAddr>,
    /// The binary it runs (`None` in records of older versions: a restart
    /// then needs `--etcd-binary` or the installed one).
    #[serde(default)]
    pub binary: Option<PathBuf>,
}

/// Starts etcd in its own session with its data in `dir`, and waits until
/// `GET /health` says healthy. `record` is called with the running process
/// before the wait, so a failure leaves it in cluster.json for `down`.
pub fn start(
    binary: &Path,
    name: &str,
    dir: &Path,
    record: impl FnOnce(&EtcdRecord) -> Result<()>,
) -> Result<EtcdRecord> {
    let (client_port, peer_port) = free_port_pair()?;
    launch(binary, name, dir, (client_port, peer_port), record)
}

/// SIGKILLs the recorded etcd (a crash: no clean shutdown) and starts it
/// again with the same name, ports and data dir, waiting until it is
/// healthy; `record` is called with the new process before the wait.
pub fn restart(
    binary: &Path,
    name: &str,
    old: &EtcdRecord,
    record: impl FnOnce(&EtcdRecord) -> Result<()>,
) -> Result<EtcdRecord> {
    if alive(old) {
        let pid = nix::unistd::Pid::from_raw(old.pid as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)
            .with_context(|| format!("SIGKILL to etcd (pid {})", old.pid))?;
        while alive(old) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let dir = old
        .data_dir
        .parent()
        .with_context(|| format!("the etcd dir above {}", old.data_dir.display()))?;
    let peer_port = match old.peer_addr {
        Some(addr) => addr.port(),
        None => free_port_pair()?.1,
    };
    launch(binary, name, dir, (old.client_addr.port(), peer_port), record)
}

/// Starts etcd on `ports` (client, peer) with its data in `dir/data`.
fn launch(
    binary: &Path,
    name: &str,
    dir: &Path,
    (client_port, peer_port): (u16, u16),
    record: impl FnOnce(&EtcdRecord) -> Result<()>,
) -> Result<EtcdRecord> {
    use std::os::unix::process::CommandExt;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let log = dir.join("etcd.log");
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .with_context(|| format!("opening {}", log.display()))?;
    let data_dir = dir.join("data");
    let mut cmd = Command::new(binary);
    cmd.arg("--name")
        .arg(name)
        .arg("--data-dir")
        .arg(&data_dir)
        .args([
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
        ])
        .args([
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
        ])
        .arg("--initial-cluster")
        .arg(format!("{name}={peer_url}"))
        .args(["--initial-cluster-state", "new"])
        // Fast raft timings: one member on loopback (FACTS.md).
        .args(["--heartbeat-interval=10", "--election-timeout=100"])
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    // Its own session: no terminal signals, outlives `rivet cluster up`.
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting etcd ({})", binary.display()))?;
    let etcd = EtcdRecord {
        pid: child.id(),
        endpoint: client_url,
        client_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, client_port)),
        data_dir,
        log: log.clone(),
        peer_addr: Some(SocketAddr::from((Ipv4Addr::LOCALHOST, peer_port))),
        binary: Some(binary.to_path_buf()),
    };
    record(&etcd)?;
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().context("checking on etcd")? {
            bail!(
                "etcd exited ({status}) before it was healthy; the end of {}:\n{}",
                log.display(),
                crate::node::log_tail(&log, 20)
            );
        }
        if healthy(etcd.client_addr) {
            return Ok(etcd);
        }
        if Instant::now() >= deadline {
            bail!(
                "etcd did not report healthy within {READY_TIMEOUT:?}; the end of {}:\n{}",
                log.display(),
                crate::node::log_tail(&log, 20)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the recorded etcd still runs (its pid is an `etcd`, not a zombie).
pub fn alive(etcd: &EtcdRecord) -> bool {
    std::fs::read_to_string(format!("/proc/{}/stat", etcd.pid)).is_ok_and(|stat| {
        let (head, rest) = stat.rsplit_once(')').unwrap_or_default();
        head.ends_with("(etcd")
            && rest
                .split_whitespace()
                .next()
                .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// SIGTERM to the recorded etcd, SIGKILL after `grace`; waits until it is gone.
pub fn stop(etcd: &EtcdRecord, grace: Duration) {
    use nix::sys::signal::{Signal, kill};
    let pid = nix::unistd::Pid::from_raw(etcd.pid as i32);
    if !alive(etcd) {
        return;
    }
    let _ = kill(pid, Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while alive(etcd) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if alive(etcd) {
        let _ = kill(pid, Signal::SIGKILL);
        while alive(etcd) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Two distinct free ports on 127.0.0.1: both bound at once, then released.
fn free_port_pair() -> Result<(u16, u16)> {
    let bind = || -> Result<(u16, TcpListener)> {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("choosing a free port for etcd")?;
        Ok((l.local_addr()?.port(), l))
    };
    let (client, _client) = bind()?;
    let (peer, _peer) = bind()?;
    Ok((client, peer))
}

/// One `GET /health`: true only for a 200 with `"health":"true"`.
pub fn healthy(addr: SocketAddr) -> bool {
    rivet_common::etcd_probe::healthy(addr, PROBE_TIMEOUT)
}
