//! Network namespaces for tests (DESIGN.md §8): nothing here touches the
//! machine's own interfaces, routes or sysctls.
//!
//! - [`NetNs`]: a uniquely named namespace (`ip netns add`), deleted on drop
//!   (even on panic), after killing every process still inside it;
//!   [`NetNs::existing`] is a handle on one someone else made (a pod of
//!   `rivet pod add`), left alone on drop.
//! - [`veth_pair`]: a veth pair between two namespaces, created directly in
//!   them (never in the host namespace).
//! - [`TestNode`] / [`TestPod`]: a simulated node namespace with pod
//!   namespaces wired the way rivet-cni wires them (see [`TestNode::add_pod`]).
//! - In-namespace traffic: [`NetNs::ping`], and TCP/UDP echo servers and
//!   clients built on std sockets created by a thread that entered the
//!   namespace ([`NetNs::spawn_in`]); a socket keeps its namespace, so it can be
//!   used from any thread afterwards.
//!
//! Everything goes through iproute2's `ip` (and `sysctl`, `ping`) run as
//! child processes; errors name the command and carry its stderr. Root
//! (CAP_SYS_ADMIN + CAP_NET_ADMIN) is required.
//!
//! Addresses used by these helpers come from the benchmarking ranges only:
//! pods get whatever the test asks for (use 198.18.0.0/15 and 2001:2::/48),
//! node namespaces get `198.19.<n>.1/32` and `2001:2:0:ffff::<n>/128` on `lo`.
//!
//! ```no_run
//! use std::time::Duration;
//! use rivet_common::testing::netns::{PodSpec, TestNode};
//!
//! # fn t() -> Result<(), rivet_common::testing::netns::NetnsError> {
//! let mut node = TestNode::new()?;
//! for (name, last) in [("a", 2u8), ("b", 3)] {
//!     let v4 = [198, 18, 0, last].into();
//!     let v6 = [0x2001, 2, 0, 0, 0, 0, 0, u16::from(last)].into();
//!     node.add_pod(
//!         PodSpec::new(name, (v4, 24), (v6, 64))
//!             .gateways([198, 18, 0, 1].into(), [0x2001, 2, 0, 0, 0, 0, 0, 1].into())
//!             .static_gateway_neighbor(true),
//!     )?;
//! }
//! let b = node.pod("b").ipv4().unwrap();
//! let stats = node.pod("a").ping(b, 3, Duration::from_millis(10), Duration::from_secs(1))?;
//! assert_eq!(stats.received, 3);
//! # Ok(()) }
//! ```

use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::mac::{format_mac, parse_mac};

/// Longest Linux interface name (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

/// Host-side veth name prefix used by [`TestNode::new`]: `rvh1`, `rvh2`, …
pub const DEFAULT_HOST_PREFIX: &str = "rvh";

/// Interface name of the pod side of every pod veth.
pub const POD_IFNAME: &str = "eth0";

/// MTU of both ends of every pod veth.
pub const POD_MTU: u32 = 1500;

/// Prefix of node namespace names (`rvn-<unique>`).
const NODE_NS_PREFIX: &str = "rvn";

/// Prefix of pod namespace names (`rvp-<unique>`).
const POD_NS_PREFIX: &str = "rvp";

/// Longest accepted [`NetNs::new`] prefix, to keep names short.
const NS_PREFIX_MAX: usize = 12;

/// Extra time a child process (`ping`) gets beyond what its arguments ask for.
const CHILD_GRACE: Duration = Duration::from_secs(10);

/// How long [`udp_echo`](NetNs::udp_echo) waits for one reply before sending again.
const UDP_RESEND: Duration = Duration::from_millis(200);

/// Everything that can go wrong; the message names the command and its stderr.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The program could not be started at all (e.g. not installed).
    #[error("could not run `{cmd}`: {source}")]
    Spawn {
        /// The command line.
        cmd: String,
        /// Why it could not be started.
        source: std::io::Error,
    },
    /// The command ran and failed.
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Failed {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: ExitStatus,
        /// Its stderr, trimmed.
        stderr: String,
    },
    /// The command did not finish in time and was killed.
    #[error("`{cmd}` did not finish within {timeout:?} and was killed")]
    Timeout {
        /// The command line.
        cmd: String,
        /// The time it had.
        timeout: Duration,
    },
    /// `ip netns add` failed: almost always missing privileges.
    #[error(
        "cannot create network namespace `{name}`: the netns test harness needs root \
         (CAP_SYS_ADMIN to create and enter namespaces, CAP_NET_ADMIN to configure them) \
         and a writable /run/netns: {source}"
    )]
    Create {
        /// The namespace name that was tried.
        name: String,
        /// The failed `ip netns add`.
        source: Box<NetnsError>,
    },
    /// The command succeeded but its output was not what was expected.
    #[error("unexpected output of `{cmd}`: {detail}")]
    Parse {
        /// The command line.
        cmd: String,
        /// What was wrong, with the offending output.
        detail: String,
    },
    /// An I/O error of the harness itself (opening a namespace, a socket, a thread).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
    /// A caller mistake (a name too long, a pod without address, …).
    #[error("invalid argument: {0}")]
    Invalid(#[from] InvalidArgument),
}

/// A caller mistake the harness refuses before touching anything.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidArgument {
    /// A namespace prefix that is empty, too long or not `[a-z0-9]`.
    #[error("namespace prefix {prefix:?} must be 1 to {NS_PREFIX_MAX} characters of [a-z0-9]")]
    NamespacePrefix {
        /// The prefix given.
        prefix: String,
    },
    /// No network namespace of that name.
    #[error("there is no network namespace {name:?} ({} does not exist)", path.display())]
    NoNamespace {
        /// The name given.
        name: String,
        /// Where it would be.
        path: std::path::PathBuf,
    },
    /// `NetNs::run` without a program.
    #[error("NetNs::run needs a program")]
    NoProgram,
    /// A sysctl that is not per network namespace.
    #[error("sysctl {key} is not per network namespace; only net.* keys may be set")]
    NotNetSysctl {
        /// The key given.
        key: String,
    },
    /// A host veth prefix that is empty or too long.
    #[error("host veth prefix {prefix:?} must be 1 to {} bytes", IFNAME_MAX - 5)]
    HostPrefix {
        /// The prefix given.
        prefix: String,
    },
    /// A pod name that is empty or already used.
    #[error("pod name {name:?} is empty or already used")]
    PodName {
        /// The name given.
        name: String,
    },
    /// A pod with neither an IPv4 nor an IPv6 address.
    #[error("pod {name} has no address")]
    PodWithoutAddress {
        /// The pod.
        name: String,
    },
    /// An interface name the kernel would refuse.
    #[error("interface name {name:?} must be 1 to {IFNAME_MAX} printable bytes without '/', ':' or spaces")]
    InterfaceName {
        /// The name given.
        name: String,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetnsError {
    let context = context.into();
    move |source| NetnsError::Io { context, source }
}

/// Serialises `ip netns add` within this process: the first ones make
/// /run/netns a shared mount point, which is racy when done concurrently.
static CREATE_LOCK: Mutex<()> = Mutex::new(());

/// Makes namespace names unique within the process (the pid makes them
/// unique across processes; a leftover of a crashed run is skipped).
static NS_COUNTER: AtomicU32 = AtomicU32::new(0);

/// Numbers the [`TestNode`]s of this process (their loopback addresses).
static NODE_COUNTER: AtomicU32 = AtomicU32::new(0);

/// A uniquely named network namespace (`ip netns add`), deleted on drop.
///
/// Drop first SIGKILLs every process still in the namespace (`ip netns
/// pids`, never this process), then runs `ip netns del`. The kernel frees the
/// namespace, and every interface in it, once the last process, thread or
/// socket using it is gone. Threads from [`spawn_in`](Self::spawn_in) and
/// sockets created in the namespace keep it alive (unnamed) until they end.
///
/// ```no_run
/// # fn t() -> Result<(), rivet_common::testing::netns::NetnsError> {
/// let ns = rivet_common::testing::netns::NetNs::new("rvt")?;
/// ns.ip(&["addr", "add", "198.18.9.1/32", "dev", "lo"])?;
/// assert!(ns.run(&["ip", "-o", "addr"])?.contains("198.18.9.1"));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct NetNs {
    name: String,
    /// Whether drop deletes the namespace (false for [`NetNs::existing`]).
    owned: bool,
}

impl NetNs {
    /// Creates `<prefix>-<pid hex><counter hex>` and brings `lo` up.
    ///
    /// `prefix` is 1 to 12 characters of `[a-z0-9]`. Fails with
    /// [`NetnsError::Create`], naming the missing privileges, when the
    /// namespace cannot be created.
    pub fn new(prefix: &str) -> Result<Self, NetnsError> {
        if prefix.is_empty()
            || prefix.len() > NS_PREFIX_MAX
            || !prefix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        {
            return Err(InvalidArgument::NamespacePrefix { prefix: prefix.into() }.into());
        }
        let pid = std::process::id();
        let mut attempts = 0;
        let ns = loop {
            let n = NS_COUNTER.fetch_add(1, Ordering::Relaxed);
            let name = format!("{prefix}-{pid:x}{n:x}");
            let created = {
                let _serialised = CREATE_LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                output(Command::new("ip").args(["netns", "add", &name]))
            };
            match created {
                Ok(_) => break Self { name, owned: true },
                // A leftover of an earlier run with the same pid: take the next number.
                Err(NetnsError::Failed { ref stderr, .. }) if stderr.contains("exists") && attempts < 64 => {
                    attempts += 1;
                }
                Err(err) => {
                    return Err(NetnsError::Create {
                        name,
                        source: Box::new(err),
                    });
                }
            }
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// A handle on the existing namespace `name` (in `ip netns list`) that
    /// leaves it alone on drop: the probes and servers of this type in a
    /// namespace someone else owns, e.g. a pod of `rivet pod add`. Fails
    /// when there is no such namespace.
    ///
    /// ```no_run
    /// # fn t() -> Result<(), rivet_common::testing::netns::NetnsError> {
    /// let pod = rivet_common::testing::netns::NetNs::existing("rivet-pod-n1-default-web")?;
    /// let _server = pod.tcp_echo_server(&["198.18.0.5:80".parse().unwrap()])?;
    /// # Ok(()) }
    /// ```
    pub fn existing(name: &str) -> Result<Self, NetnsError> {
        let ns = Self {
            name: name.to_owned(),
            owned: false,
        };
        if !ns.path().exists() || name.contains('/') {
            return Err(InvalidArgument::NoNamespace {
                name: name.into(),
                path: ns.path().to_path_buf(),
            }
            .into());
        }
        Ok(ns)
    }

    /// The namespace name (as in `ip netns list`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>` (`/var/run/netns/<name>` where /run/netns does not exist).
    pub fn path(&self) -> PathBuf {
        let run = Path::new("/run/netns");
        let dir = if run.is_dir() { run } else { Path::new("/var/run/netns") };
        dir.join(&self.name)
    }

    /// `ip netns exec <name> <program>`; add arguments and run it as usual.
    ///
    /// ```no_run
    /// # fn t(ns: &rivet_common::testing::netns::NetNs) -> std::io::Result<()> {
    /// let mut server = ns.command("iperf3").args(["-s", "-1"]).spawn()?;
    /// # server.kill() }
    /// ```
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program).env("LC_ALL", "C");
        cmd
    }

    /// Runs `args[0]` with the rest as arguments inside the namespace; its stdout.
    pub fn run(&self, args: &[&str]) -> Result<String, NetnsError> {
        let (program, rest) = args
            .split_first()
            .ok_or(NetnsError::Invalid(InvalidArgument::NoProgram))?;
        let out = output(self.command(program).args(rest))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `ip -n <name> <args>`; its stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String, NetnsError> {
        let out = output(Command::new("ip").args(["-n", &self.name]).args(args))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Interface index of `ifname` in this namespace.
    pub fn ifindex(&self, ifname: &str) -> Result<u32, NetnsError> {
        Ok(self.link(ifname)?.0)
    }

    /// MAC address of `ifname` in this namespace.
    pub fn mac(&self, ifname: &str) -> Result<[u8; 6], NetnsError> {
        Ok(self.link(ifname)?.1)
    }

    /// `(rx_packets, tx_packets)` of `ifname`, from `ip -s -j link show`.
    pub fn link_packets(&self, ifname: &str) -> Result<(u64, u64), NetnsError> {
        let json = self.ip(&["-s", "-j", "link", "show", "dev", ifname])?;
        let value: serde_json::Value = serde_json::from_str(&json).ok().unwrap_or_default();
        let count = |dir: &str| value[0]["stats64"][dir]["packets"].as_u64();
        match (count("rx"), count("tx")) {
            (Some(rx), Some(tx)) => Ok((rx, tx)),
            _ => Err(NetnsError::Parse {
                cmd: format!("ip -n {} -s -j link show dev {ifname}", self.name),
                detail: format!("no stats64 packet counters in {json:?}"),
            }),
        }
    }

    /// [`ip`](Self::ip) with the arguments split at whitespace (for names
    /// already checked to contain none).
    fn ipw(&self, args: &str) -> Result<String, NetnsError> {
        self.ip(&args.split_whitespace().collect::<Vec<_>>())
    }

    /// Whether `ifname` exists in this namespace.
    pub fn has_link(&self, ifname: &str) -> Result<bool, NetnsError> {
        let out = self.ip(&["-o", "link", "show"])?;
        Ok(out.lines().any(|line| link_line_name(line) == Some(ifname)))
    }

    /// `(ifindex, mac)` of `ifname`, from `ip -j link show dev <ifname>`.
    fn link(&self, ifname: &str) -> Result<(u32, [u8; 6]), NetnsError> {
        let args = ["-j", "link", "show", "dev", ifname];
        let json = self.ip(&args)?;
        let cmd = format!("ip -n {} {}", self.name, args.join(" "));
        let parse_err = |detail: &str| NetnsError::Parse {
            cmd: cmd.clone(),
            detail: format!("{detail} in {json:?}"),
        };
        let value: serde_json::Value = serde_json::from_str(&json).map_err(|e| parse_err(&e.to_string()))?;
        let link = value.get(0).ok_or_else(|| parse_err("no link"))?;
        let ifindex = link
            .get("ifindex")
            .and_then(serde_json::Value::as_u64)
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| parse_err("no ifindex"))?;
        let mac = link
            .get("address")
            .and_then(serde_json::Value::as_str)
            .and_then(parse_mac)
            .ok_or_else(|| parse_err("no MAC address"))?;
        Ok((ifindex, mac))
    }

    /// `sysctl -qw <key>=<value>` inside the namespace only (net.* keys are
    /// per namespace; never use this for others).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<(), NetnsError> {
        self.sysctls(&[(key, value)])
    }

    /// Several `sysctl -qw` settings in one child process.
    pub fn sysctls(&self, settings: &[(&str, &str)]) -> Result<(), NetnsError> {
        if let Some((key, _)) = settings.iter().find(|(key, _)| !key.starts_with("net.")) {
            return Err(InvalidArgument::NotNetSysctl { key: (*key).into() }.into());
        }
        let pairs: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
        output(self.command("sysctl").arg("-qw").args(&pairs))?;
        Ok(())
    }

    /// Spawns a thread that enters this namespace (`setns(CLONE_NEWNET)`,
    /// that thread only) and runs `f`. Returns once the thread is inside.
    ///
    /// Sockets created by `f` stay in this namespace wherever they are used.
    ///
    /// ```no_run
    /// # fn t(ns: &rivet_common::testing::netns::NetNs) -> Result<(), rivet_common::testing::netns::NetnsError> {
    /// let listener = ns.spawn_in(|| std::net::TcpListener::bind("198.18.0.2:8080"))?.join().unwrap();
    /// # Ok(()) }
    /// ```
    pub fn spawn_in<F, T>(&self, f: F) -> Result<JoinHandle<T>, NetnsError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let path = self.path();
        let file = File::open(&path).map_err(io_err(format!("opening {}", path.display())))?;
        let (entered_tx, entered_rx) = std::sync::mpsc::sync_channel::<nix::Result<()>>(1);
        let handle = std::thread::Builder::new()
            .name(format!("ns-{}", self.name))
            .spawn(move || {
                let entered = setns(&file, CloneFlags::CLONE_NEWNET);
                drop(file);
                let failed = entered.is_err();
                let _ = entered_tx.send(entered);
                if failed {
                    // Never run `f` in the wrong namespace; the caller reports the error.
                    std::panic::resume_unwind(Box::new("setns failed"));
                }
                f()
            })
            .map_err(io_err("spawning a thread"))?;
        let entered = entered_rx.recv().unwrap_or(Err(nix::Error::ECHILD));
        if let Err(errno) = entered {
            let _ = handle.join();
            return Err(NetnsError::Io {
                context: format!("setns(CLONE_NEWNET) into {} (needs CAP_SYS_ADMIN)", path.display()),
                source: errno.into(),
            });
        }
        Ok(handle)
    }

    /// Runs `f` on a thread inside the namespace and waits for it; a panic
    /// in `f` is resumed on the calling thread.
    pub fn in_ns<F, T>(&self, f: F) -> Result<T, NetnsError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        match self.spawn_in(f)?.join() {
            Ok(value) => Ok(value),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// `ping -c <count> -i <interval> -W <timeout> -q` (`-6` for IPv6) from
    /// this namespace. Losing packets is not an error: look at the stats.
    ///
    /// Intervals below 2 ms need root, which the harness has anyway.
    pub fn ping(
        &self,
        dst: IpAddr,
        count: u32,
        interval: Duration,
        timeout: Duration,
    ) -> Result<PingStats, NetnsError> {
        let family = if dst.is_ipv4() { "-4" } else { "-6" };
        let mut cmd = self.command("ping");
        cmd.args([family, "-n", "-q", "-c", &count.to_string()])
            .args(["-i", &format!("{:.6}", interval.as_secs_f64())])
            .args(["-W", &format!("{:.3}", timeout.as_secs_f64().max(0.001))])
            .arg(dst.to_string());
        let limit = interval * count + timeout + CHILD_GRACE;
        let (status, stdout, stderr) = output_within(&mut cmd, limit)?;
        match parse_ping(&stdout) {
            // Exit status 1 means "not every reply came back": still a result.
            Some(stats) if status.success() || status.code() == Some(1) => Ok(stats),
            _ => Err(NetnsError::Failed {
                cmd: describe(&cmd),
                status,
                stderr: format!("{}{}", stderr.trim(), stdout.trim()),
            }),
        }
    }

    /// Whether a TCP connection to `dst` is established from this namespace
    /// within `timeout` (it is closed at once). Refused, reset, unreachable
    /// and timed out are `Ok(false)`; harness failures are errors.
    pub fn tcp_connect(&self, dst: SocketAddr, timeout: Duration) -> Result<bool, NetnsError> {
        not_reached_is_false(self.in_ns(move || TcpStream::connect_timeout(&dst, timeout))?).map(|s| s.is_some())
    }

    /// Connects to `dst`, sends a few bytes and whether the same bytes come
    /// back within `timeout` (what the echo servers here do).
    pub fn tcp_echo(&self, dst: SocketAddr, timeout: Duration) -> Result<bool, NetnsError> {
        let result = self.in_ns(move || -> std::io::Result<bool> {
            let deadline = Instant::now() + timeout;
            let mut stream = TcpStream::connect_timeout(&dst, timeout)?;
            let payload = token("tcp");
            stream.set_write_timeout(Some(remaining(deadline)))?;
            stream.write_all(&payload)?;
            let mut back = vec![0; payload.len()];
            stream.set_read_timeout(Some(remaining(deadline)))?;
            stream.read_exact(&mut back)?;
            Ok(back == payload)
        })?;
        Ok(not_reached_is_false(result)?.unwrap_or(false))
    }

    /// A TCP connection to `dst` made from this namespace, usable from any
    /// thread (e.g. held open across a policy change).
    pub fn tcp_stream(&self, dst: SocketAddr, timeout: Duration) -> Result<TcpStream, NetnsError> {
        self.in_ns(move || TcpStream::connect_timeout(&dst, timeout))?
            .map_err(io_err(format!("connecting to {dst} from {}", self.name)))
    }

    /// A UDP socket bound in this namespace (e.g. `0.0.0.0:0`), usable from any thread.
    pub fn udp_socket(&self, bind: SocketAddr) -> Result<UdpSocket, NetnsError> {
        self.in_ns(move || UdpSocket::bind(bind))?
            .map_err(io_err(format!("binding UDP {bind} in {}", self.name)))
    }

    /// Sends a datagram to `dst` (again every 200 ms) until the same bytes
    /// come back or `timeout` passes; whether they came back. A refusal
    /// (ICMP port unreachable) is `Ok(false)` at once.
    pub fn udp_echo(&self, dst: SocketAddr, timeout: Duration) -> Result<bool, NetnsError> {
        let local = match dst {
            SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
        };
        self.udp_echo_from(local, dst, timeout)
    }

    /// [`udp_echo`](Self::udp_echo) from a socket bound to `local`: a
    /// source port of the caller's choosing, e.g. one no earlier probe used,
    /// so that no conntrack entry of an earlier exchange can answer for it.
    pub fn udp_echo_from(&self, local: SocketAddr, dst: SocketAddr, timeout: Duration) -> Result<bool, NetnsError> {
        let result = self.in_ns(move || -> std::io::Result<bool> {
            let deadline = Instant::now() + timeout;
            let socket = UdpSocket::bind(local)?;
            socket.connect(dst)?;
            let payload = token("udp");
            let mut buf = [0u8; 2048];
            while Instant::now() < deadline {
                socket.send(&payload)?;
                let resend = Instant::now() + UDP_RESEND;
                while Instant::now() < resend.min(deadline) {
                    socket.set_read_timeout(Some(remaining(resend.min(deadline))))?;
                    match socket.recv(&mut buf) {
                        Ok(n) if buf[..n] == payload[..] => return Ok(true),
                        Ok(_) => {} // A stale reply of an earlier try.
                        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            Ok(false)
        })?;
        Ok(not_reached_is_false(result)?.unwrap_or(false))
    }

    /// A TCP echo server on each of `addrs` (bound in this namespace), until
    /// the guard is dropped. Port 0 picks a free port, the same for all.
    pub fn tcp_echo_server(&self, addrs: &[SocketAddr]) -> Result<TcpServerGuard, NetnsError> {
        let addrs = addrs.to_vec();
        let bound = self.in_ns(move || bind_all(&addrs, TcpListener::bind))?;
        let listeners = bound.map_err(io_err(format!("binding TCP echo server in {}", self.name)))?;
        let addrs = local_addrs(&listeners, TcpListener::local_addr)?;
        let counter = Arc::new(AtomicU64::new(0));
        let served = Arc::clone(&counter);
        let server = Server::start(&format!("tcp-echo-{}", self.name), move || async move {
            for listener in listeners {
                let served = Arc::clone(&served);
                tokio::spawn(serve_tcp(listener, served));
            }
        })?;
        Ok(TcpServerGuard {
            addrs,
            connections: counter,
            _server: server,
        })
    }

    /// A UDP echo server on each of `addrs` (bound in this namespace), until
    /// the guard is dropped. Port 0 picks a free port, the same for all.
    pub fn udp_echo_server(&self, addrs: &[SocketAddr]) -> Result<UdpServerGuard, NetnsError> {
        let addrs = addrs.to_vec();
        let bound = self.in_ns(move || bind_all(&addrs, UdpSocket::bind))?;
        let sockets = bound.map_err(io_err(format!("binding UDP echo server in {}", self.name)))?;
        let addrs = local_addrs(&sockets, UdpSocket::local_addr)?;
        let counter = Arc::new(AtomicU64::new(0));
        let served = Arc::clone(&counter);
        let server = Server::start(&format!("udp-echo-{}", self.name), move || async move {
            for socket in sockets {
                let served = Arc::clone(&served);
                tokio::spawn(serve_udp(socket, served));
            }
        })?;
        Ok(UdpServerGuard {
            addrs,
            datagrams: counter,
            _server: server,
        })
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let me = std::process::id();
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &self.name]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                match pid.parse::<i32>() {
                    Ok(pid) if u32::try_from(pid).is_ok_and(|p| p != me) => {
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                    _ => {}
                }
            }
        }
        if let Err(err) = output(Command::new("ip").args(["netns", "del", &self.name])) {
            eprintln!(
                "rivet netns harness: could not delete network namespace {}: {err}",
                self.name
            );
        }
    }
}

/// A veth pair: `a_name` in `a_ns`, `b_name` in `b_ns` (both at most 15
/// bytes), both up. Created directly in the two namespaces: no interface
/// ever appears in the host namespace. Deleting either namespace removes the
/// pair. `a_ns` and `b_ns` may be the same namespace.
pub fn veth_pair(a_ns: &NetNs, a_name: &str, b_ns: &NetNs, b_name: &str) -> Result<(), NetnsError> {
    check_ifname(a_name)?;
    check_ifname(b_name)?;
    a_ns.ipw(&format!(
        "link add {a_name} type veth peer name {b_name} netns {}",
        b_ns.name()
    ))?;
    a_ns.ip(&["link", "set", a_name, "up"])?;
    b_ns.ip(&["link", "set", b_name, "up"])?;
    Ok(())
}

/// Names currently in `ip netns list`.
pub fn list_netns() -> Result<Vec<String>, NetnsError> {
    let out = output(Command::new("ip").args(["netns", "list"]))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// What one pod looks like; see [`TestNode::add_pod`].
///
/// ```
/// use rivet_common::testing::netns::PodSpec;
/// let spec = PodSpec::new("a", ([198, 18, 0, 2].into(), 24), ([0x2001, 2, 0, 0, 0, 0, 0, 2].into(), 64))
///     .gateways([198, 18, 0, 1].into(), [0x2001, 2, 0, 0, 0, 0, 0, 1].into());
/// assert!(!spec.static_gateway_neighbor);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSpec {
    /// Label for lookups ([`TestNode::pod`]) and messages; unique per node.
    pub name: String,
    /// Address and prefix length on the pod's `eth0`.
    pub ipv4: Option<(Ipv4Addr, u8)>,
    /// Address and prefix length on the pod's `eth0` (added with `nodad`).
    pub ipv6: Option<(Ipv6Addr, u8)>,
    /// The pod's IPv4 gateway; not assigned to any interface.
    pub gateway4: Option<Ipv4Addr>,
    /// The pod's IPv6 gateway; not assigned to any interface.
    pub gateway6: Option<Ipv6Addr>,
    /// Install permanent neighbour entries in the pod mapping the gateways to
    /// the host veth's MAC, for tests without the datapath (which otherwise
    /// answers ARP/ND for the gateway).
    pub static_gateway_neighbor: bool,
}

impl PodSpec {
    /// A dual-stack pod without gateways.
    pub fn new(name: &str, ipv4: (Ipv4Addr, u8), ipv6: (Ipv6Addr, u8)) -> Self {
        Self {
            name: name.to_owned(),
            ipv4: Some(ipv4),
            ipv6: Some(ipv6),
            ..Self::default()
        }
    }

    /// Sets both gateways.
    pub fn gateways(mut self, gateway4: Ipv4Addr, gateway6: Ipv6Addr) -> Self {
        self.gateway4 = Some(gateway4);
        self.gateway6 = Some(gateway6);
        self
    }

    /// Sets [`static_gateway_neighbor`](Self::static_gateway_neighbor).
    pub fn static_gateway_neighbor(mut self, on: bool) -> Self {
        self.static_gateway_neighbor = on;
        self
    }
}

/// A simulated node: a node namespace plus pod namespaces (see [`add_pod`](Self::add_pod)).
///
/// The node namespace has IPv4 and IPv6 forwarding on, IPv6 DAD off, and
/// one address per family on `lo` ([`loopback4`](Self::loopback4),
/// [`loopback6`](Self::loopback6)): with no address on the host veths, the
/// kernel uses it as the sender of its ARP requests for pods. It has no
/// proxy ARP/ND. Dropping the node deletes the pods' namespaces, then its own.
#[derive(Debug)]
pub struct TestNode {
    // Declared first: pods go before the node namespace.
    pods: Vec<TestPod>,
    /// The node namespace (`rvn-…`).
    pub ns: NetNs,
    /// `198.19.<n>.1`, on `lo` as /32.
    pub loopback4: Ipv4Addr,
    /// `2001:2:0:ffff::<n>`, on `lo` as /128.
    pub loopback6: Ipv6Addr,
    host_prefix: String,
    next_pod: u32,
}

impl TestNode {
    /// A node whose host veths are `rvh1`, `rvh2`, …
    pub fn new() -> Result<Self, NetnsError> {
        Self::with_host_prefix(DEFAULT_HOST_PREFIX)
    }

    /// A node whose host veths are `<host_prefix>1`, `<host_prefix>2`, …
    /// (`host_prefix` at most 10 bytes, so names fit 15).
    pub fn with_host_prefix(host_prefix: &str) -> Result<Self, NetnsError> {
        if host_prefix.is_empty() || host_prefix.len() > IFNAME_MAX - 5 {
            return Err(InvalidArgument::HostPrefix {
                prefix: host_prefix.into(),
            }
            .into());
        }
        check_ifname(host_prefix)?;
        let n = NODE_COUNTER.fetch_add(1, Ordering::Relaxed) % 254 + 1;
        let loopback4 = Ipv4Addr::new(198, 19, n as u8, 1);
        let loopback6 = Ipv6Addr::new(0x2001, 2, 0, 0xffff, 0, 0, 0, n as u16);
        let ns = NetNs::new(NODE_NS_PREFIX)?;
        ns.sysctls(&[
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            // Host veths must have a usable link-local address at once:
            // a tentative one cannot send neighbour solicitations.
            ("net.ipv6.conf.all.accept_dad", "0"),
            ("net.ipv6.conf.default.accept_dad", "0"),
        ])?;
        ns.ipw(&format!("addr add {loopback4}/32 dev lo"))?;
        ns.ipw(&format!("-6 addr add {loopback6}/128 dev lo nodad"))?;
        Ok(Self {
            pods: Vec::new(),
            ns,
            loopback4,
            loopback6,
            host_prefix: host_prefix.to_owned(),
            next_pod: 1,
        })
    }

    /// Creates a pod namespace wired to the node like rivet-cni does:
    ///
    /// - a veth pair, `<host prefix><n>` in the node namespace and `eth0` in
    ///   the pod, MTU 1500, both up;
    /// - in the pod, each address with its prefix length but `noprefixroute`
    ///   (IPv6 also `nodad`), a link route to the gateway (`<gw>/32`,
    ///   `<gw6>/128 dev eth0`) and the default route via it with the pod's
    ///   address as source: everything, other pods of the same prefix
    ///   included, goes through the host veth. A family without gateway gets
    ///   its ordinary prefix route instead and no default route;
    /// - with `static_gateway_neighbor`, `ip neigh replace <gw> lladdr
    ///   <host veth MAC> nud permanent` in the pod for each gateway;
    /// - in the node, `<pod ip>/32` and `<pod ip6>/128 dev <host veth>`.
    ///
    /// The gateway address is on no interface: the datapath under test
    /// answers ARP/ND for it, or the static neighbour entries stand in.
    pub fn add_pod(&mut self, spec: PodSpec) -> Result<&TestPod, NetnsError> {
        if spec.name.is_empty() || self.pods.iter().any(|p| p.spec.name == spec.name) {
            return Err(InvalidArgument::PodName { name: spec.name }.into());
        }
        if spec.ipv4.is_none() && spec.ipv6.is_none() {
            return Err(InvalidArgument::PodWithoutAddress { name: spec.name }.into());
        }
        let host_ifname = format!("{}{}", self.host_prefix, self.next_pod);
        check_ifname(&host_ifname)?;
        self.next_pod += 1;

        let ns = NetNs::new(POD_NS_PREFIX)?;
        ns.sysctls(&[
            ("net.ipv6.conf.all.accept_dad", "0"),
            ("net.ipv6.conf.default.accept_dad", "0"),
        ])?;
        let node = &self.ns;
        node.ipw(&format!(
            "link add {host_ifname} type veth peer name {POD_IFNAME} netns {}",
            ns.name()
        ))?;
        node.ipw(&format!("link set {host_ifname} mtu {POD_MTU} up"))?;
        ns.ipw(&format!("link set {POD_IFNAME} mtu {POD_MTU} up"))?;
        let (host_ifindex, host_mac) = node.link(&host_ifname)?;
        let pod_mac = ns.mac(POD_IFNAME)?;
        let host_mac_text = format_mac(&host_mac);

        if let Some((addr, len)) = spec.ipv4 {
            let cidr = format!("{addr}/{len}");
            let mut add = vec!["addr", "add", &cidr, "dev", POD_IFNAME];
            if let Some(gw) = spec.gateway4 {
                add.push("noprefixroute");
                ns.ip(&add)?;
                ns.ipw(&format!("route add {gw}/32 dev {POD_IFNAME} scope link"))?;
                ns.ipw(&format!("route add default via {gw} dev {POD_IFNAME} src {addr}"))?;
                if spec.static_gateway_neighbor {
                    ns.ipw(&format!(
                        "neigh replace {gw} lladdr {host_mac_text} dev {POD_IFNAME} nud permanent"
                    ))?;
                }
            } else {
                ns.ip(&add)?;
            }
            node.ipw(&format!("route add {addr}/32 dev {host_ifname}"))?;
        }
        if let Some((addr, len)) = spec.ipv6 {
            let cidr = format!("{addr}/{len}");
            let mut add = vec!["-6", "addr", "add", &cidr, "dev", POD_IFNAME, "nodad"];
            if let Some(gw) = spec.gateway6 {
                add.push("noprefixroute");
                ns.ip(&add)?;
                ns.ipw(&format!("-6 route add {gw}/128 dev {POD_IFNAME}"))?;
                ns.ipw(&format!("-6 route add default via {gw} dev {POD_IFNAME} src {addr}"))?;
                if spec.static_gateway_neighbor {
                    ns.ipw(&format!(
                        "-6 neigh replace {gw} lladdr {host_mac_text} dev {POD_IFNAME} nud permanent"
                    ))?;
                }
            } else {
                ns.ip(&add)?;
            }
            node.ipw(&format!("-6 route add {addr}/128 dev {host_ifname}"))?;
        }

        self.pods.push(TestPod {
            ns,
            spec,
            host_ifname,
            host_ifindex,
            host_mac,
            pod_mac,
        });
        Ok(self.pods.last().expect("just pushed"))
    }

    /// The pods, in creation order.
    pub fn pods(&self) -> &[TestPod] {
        &self.pods
    }

    /// The pod labelled `name`.
    ///
    /// # Panics
    /// When there is none (a test mistake).
    pub fn pod(&self, name: &str) -> &TestPod {
        self.try_pod(name)
            .unwrap_or_else(|| panic!("no pod {name:?} on node {}", self.ns.name()))
    }

    /// The pod labelled `name`, if any.
    pub fn try_pod(&self, name: &str) -> Option<&TestPod> {
        self.pods.iter().find(|p| p.spec.name == name)
    }

    /// Removes the pod labelled `name` (its namespace is deleted, which takes
    /// its veth pair, the host side included); its node routes go with the
    /// host veth. Returns whether there was one.
    pub fn remove_pod(&mut self, name: &str) -> bool {
        let before = self.pods.len();
        self.pods.retain(|p| p.spec.name != name);
        self.pods.len() != before
    }
}

/// A pod of a [`TestNode`]: its namespace and how it is wired.
#[derive(Debug)]
pub struct TestPod {
    /// The pod namespace (`rvp-…`); the pod's interface is [`POD_IFNAME`].
    pub ns: NetNs,
    /// What it was created from.
    pub spec: PodSpec,
    /// Host side of its veth, in the node namespace.
    pub host_ifname: String,
    /// Index of the host veth in the node namespace.
    pub host_ifindex: u32,
    /// MAC of the host veth (the pod's gateway MAC).
    pub host_mac: [u8; 6],
    /// MAC of the pod's `eth0`.
    pub pod_mac: [u8; 6],
}

impl TestPod {
    /// The pod's IPv4 address.
    pub fn ipv4(&self) -> Option<IpAddr> {
        self.spec.ipv4.map(|(a, _)| IpAddr::V4(a))
    }

    /// The pod's IPv6 address.
    pub fn ipv6(&self) -> Option<IpAddr> {
        self.spec.ipv6.map(|(a, _)| IpAddr::V6(a))
    }

    /// The pod's addresses, IPv4 first.
    pub fn addrs(&self) -> Vec<IpAddr> {
        self.ipv4().into_iter().chain(self.ipv6()).collect()
    }

    /// See [`NetNs::ping`].
    pub fn ping(
        &self,
        dst: IpAddr,
        count: u32,
        interval: Duration,
        timeout: Duration,
    ) -> Result<PingStats, NetnsError> {
        self.ns.ping(dst, count, interval, timeout)
    }

    /// See [`NetNs::tcp_connect`].
    pub fn tcp_connect(&self, dst: SocketAddr, timeout: Duration) -> Result<bool, NetnsError> {
        self.ns.tcp_connect(dst, timeout)
    }

    /// See [`NetNs::tcp_echo`].
    pub fn tcp_echo(&self, dst: SocketAddr, timeout: Duration) -> Result<bool, NetnsError> {
        self.ns.tcp_echo(dst, timeout)
    }

    /// See [`NetNs::tcp_stream`].
    pub fn tcp_stream(&self, dst: SocketAddr, timeout: Duration) -> Result<TcpStream, NetnsError> {
        self.ns.tcp_stream(dst, timeout)
    }

    /// See [`NetNs::udp_echo`].
    pub fn udp_echo(&self, dst: SocketAddr, timeout: Duration) -> Result<bool, NetnsError> {
        self.ns.udp_echo(dst, timeout)
    }

    /// A TCP echo server on `port` of each of the pod's addresses (port 0: a
    /// free one, see [`TcpServerGuard::port`]).
    pub fn tcp_server(&self, port: u16) -> Result<TcpServerGuard, NetnsError> {
        let addrs: Vec<SocketAddr> = self.addrs().into_iter().map(|a| SocketAddr::new(a, port)).collect();
        self.ns.tcp_echo_server(&addrs)
    }

    /// A UDP echo server on `port` of each of the pod's addresses (port 0: a
    /// free one, see [`UdpServerGuard::port`]).
    pub fn udp_server(&self, port: u16) -> Result<UdpServerGuard, NetnsError> {
        let addrs: Vec<SocketAddr> = self.addrs().into_iter().map(|a| SocketAddr::new(a, port)).collect();
        self.ns.udp_echo_server(&addrs)
    }
}

/// Result of [`NetNs::ping`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PingStats {
    /// Echo requests sent.
    pub transmitted: u32,
    /// Echo replies received.
    pub received: u32,
}

impl PingStats {
    /// `transmitted - received` (never negative).
    pub fn lost(&self) -> u32 {
        self.transmitted.saturating_sub(self.received)
    }
}

/// A TCP echo server in a namespace; stops (closing every connection) on drop.
#[derive(Debug)]
pub struct TcpServerGuard {
    addrs: Vec<SocketAddr>,
    connections: Arc<AtomicU64>,
    _server: Server,
}

impl TcpServerGuard {
    /// The bound addresses.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The port (the same on every address).
    pub fn port(&self) -> u16 {
        self.addrs[0].port()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }
}

/// A UDP echo server in a namespace; stops on drop.
#[derive(Debug)]
pub struct UdpServerGuard {
    addrs: Vec<SocketAddr>,
    datagrams: Arc<AtomicU64>,
    _server: Server,
}

impl UdpServerGuard {
    /// The bound addresses.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The port (the same on every address).
    pub fn port(&self) -> u16 {
        self.addrs[0].port()
    }

    /// Datagrams received (and echoed) so far.
    pub fn datagrams(&self) -> u64 {
        self.datagrams.load(Ordering::Relaxed)
    }
}

/// A thread running a current-thread tokio runtime until dropped. The
/// sockets it serves were created in their namespace beforehand, so this
/// thread need not enter it.
#[derive(Debug)]
struct Server {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Runs `setup` (which spawns the serving tasks) on a new runtime thread.
    fn start<S, Fut>(name: &str, setup: S) -> Result<Self, NetnsError>
    where
        S: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_err("building a tokio runtime"))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(move || {
                runtime.block_on(async move {
                    setup().await;
                    // Err: the guard was dropped, which is the signal as well.
                    let _ = stopped.await;
                });
                // Dropping the runtime cancels the tasks, closing their sockets.
            })
            .map_err(io_err("spawning a server thread"))?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve_tcp(listener: TcpListener, connections: Arc<AtomicU64>) {
    let listener = match listener
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpListener::from_std(listener))
    {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("rivet netns harness: TCP echo server: {err}");
            return;
        }
    };
    loop {
        match listener.accept().await {
            Ok((mut stream, _)) => {
                connections.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let (mut rd, mut wr) = stream.split();
                    let _ = tokio::io::copy(&mut rd, &mut wr).await;
                });
            }
            // E.g. EMFILE or an aborted handshake: keep serving.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

async fn serve_udp(socket: UdpSocket, datagrams: Arc<AtomicU64>) {
    let socket = match socket
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UdpSocket::from_std(socket))
    {
        Ok(socket) => socket,
        Err(err) => {
            eprintln!("rivet netns harness: UDP echo server: {err}");
            return;
        }
    };
    let mut buf = vec![0u8; 65536];
    loop {
        match socket.recv_from(&mut buf).await {
            Ok((n, peer)) => {
                datagrams.fetch_add(1, Ordering::Relaxed);
                let _ = socket.send_to(&buf[..n], peer).await;
            }
            // ICMP errors of earlier replies surface here: keep serving.
            Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

/// Binds `addrs` in order; a port 0 is replaced by the first socket's port.
fn bind_all<S>(addrs: &[SocketAddr], bind: impl Fn(SocketAddr) -> std::io::Result<S>) -> std::io::Result<Vec<S>>
where
    S: HasLocalAddr,
{
    if addrs.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "no address to bind",
        ));
    }
    let mut port = addrs[0].port();
    let mut out = Vec::with_capacity(addrs.len());
    for addr in addrs {
        let mut addr = *addr;
        if addr.port() == 0 {
            addr.set_port(port);
        }
        let socket = bind(addr).map_err(|e| std::io::Error::new(e.kind(), format!("binding {addr}: {e}")))?;
        port = socket.local_port()?;
        out.push(socket);
    }
    Ok(out)
}

/// The std sockets [`bind_all`] binds.
trait HasLocalAddr {
    fn local_port(&self) -> std::io::Result<u16>;
}

impl HasLocalAddr for TcpListener {
    fn local_port(&self) -> std::io::Result<u16> {
        Ok(self.local_addr()?.port())
    }
}

impl HasLocalAddr for UdpSocket {
    fn local_port(&self) -> std::io::Result<u16> {
        Ok(self.local_addr()?.port())
    }
}

fn local_addrs<S>(sockets: &[S], local: fn(&S) -> std::io::Result<SocketAddr>) -> Result<Vec<SocketAddr>, NetnsError> {
    sockets
        .iter()
        .map(|s| local(s).map_err(io_err("reading a bound address")))
        .collect()
}

/// Maps "the peer was not reached" errors to `Ok(None)`.
fn not_reached_is_false<T>(result: std::io::Result<T>) -> Result<Option<T>, NetnsError> {
    use std::io::ErrorKind as K;
    match result {
        Ok(value) => Ok(Some(value)),
        Err(e)
            if matches!(
                e.kind(),
                K::TimedOut
                    | K::WouldBlock
                    | K::ConnectionRefused
                    | K::ConnectionReset
                    | K::ConnectionAborted
                    | K::HostUnreachable
                    | K::NetworkUnreachable
                    | K::UnexpectedEof
                    | K::BrokenPipe
            ) =>
        {
            Ok(None)
        }
        Err(source) => Err(NetnsError::Io {
            context: "socket operation in a test namespace".to_owned(),
            source,
        }),
    }
}

/// A payload unlikely to be confused with another test's.
fn token(kind: &str) -> Vec<u8> {
    format!("rivet-{kind}-{:016x}", rand::random::<u64>()).into_bytes()
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn check_ifname(name: &str) -> Result<(), NetnsError> {
    if name.is_empty()
        || name.len() > IFNAME_MAX
        || name == "."
        || name == ".."
        || name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace() || !b.is_ascii_graphic())
    {
        return Err(InvalidArgument::InterfaceName { name: name.into() }.into());
    }
    Ok(())
}

/// The interface name of an `ip -o link show` line (`5: rvh1@if4: <…`).
fn link_line_name(line: &str) -> Option<&str> {
    let name = line.split(": ").nth(1)?;
    Some(name.split('@').next().unwrap_or(name))
}

/// Parses iputils' `N packets transmitted, M received, …` line.
fn parse_ping(stdout: &str) -> Option<PingStats> {
    let line = stdout.lines().find(|l| l.contains("packets transmitted"))?;
    let mut fields = line.split(',').map(str::trim);
    let transmitted = fields.next()?.split_whitespace().next()?.parse().ok()?;
    let received = fields
        .find(|f| f.ends_with("received"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(PingStats { transmitted, received })
}

/// The command line, for messages.
fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` to completion; an error unless it exits 0.
fn output(cmd: &mut Command) -> Result<Output, NetnsError> {
    let out = cmd.stdin(Stdio::null()).output().map_err(|source| NetnsError::Spawn {
        cmd: describe(cmd),
        source,
    })?;
    if !out.status.success() {
        return Err(NetnsError::Failed {
            cmd: describe(cmd),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(out)
}

/// Runs `cmd`, killing it after `limit`; its status, stdout and stderr.
fn output_within(cmd: &mut Command, limit: Duration) -> Result<(ExitStatus, String, String), NetnsError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| NetnsError::Spawn {
            cmd: describe(cmd),
            source,
        })?;
    let readers = [
        child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
        child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .map(|pipe| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_string(&mut text);
            }
            text
        })
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(NetnsError::Timeout {
                    cmd: describe(cmd),
                    timeout: limit,
                });
            }
            Err(err) => return Err(io_err(format!("waiting for `{}`", describe(cmd)))(err)),
        }
    };
    let [stdout, stderr] = readers.map(|r| r.join().unwrap_or_default());
    Ok((status, stdout, stderr))
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(2);

    fn v4(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 0, last)
    }

    fn v6(last: u16) -> Ipv6Addr {
        Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, last)
    }

    /// A node with pods "a" (.2, ::2) and "b" (.3, ::3) on 198.18.0.0/24 and
    /// 2001:2::/64, static gateway neighbours, no datapath.
    fn two_pod_node() -> TestNode {
        let mut node = TestNode::new().expect("creating the node namespace");
        for (name, last) in [("a", 2u8), ("b", 3)] {
            node.add_pod(
                PodSpec::new(name, (v4(last), 24), (v6(u16::from(last)), 64))
                    .gateways(v4(1), v6(1))
                    .static_gateway_neighbor(true),
            )
            .unwrap_or_else(|e| panic!("adding pod {name}: {e}"));
        }
        node
    }

    /// Polls `cond` for up to 10 s.
    fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn assert_gone(names: &[String]) {
        let listed = list_netns().unwrap();
        for name in names {
            assert!(!listed.contains(name), "{name} still in `ip netns list`: {listed:?}");
            assert!(
                !Path::new("/run/netns").join(name).exists(),
                "/run/netns/{name} still exists"
            );
        }
    }

    #[test]
    fn netns_parse_helpers() {
        let out = "PING 198.18.0.3 (198.18.0.3) 56(84) bytes of data.\n\n--- 198.18.0.3 ping statistics ---\n\
                   5 packets transmitted, 4 received, 20% packet loss, time 4005ms\nrtt min/avg/max/mdev = 0.1/0.1/0.1/0.0 ms\n";
        assert_eq!(
            parse_ping(out),
            Some(PingStats {
                transmitted: 5,
                received: 4
            })
        );
        let errors = "3 packets transmitted, 0 received, +3 errors, 100% packet loss, time 2040ms\n";
        assert_eq!(
            parse_ping(errors),
            Some(PingStats {
                transmitted: 3,
                received: 0
            })
        );
        assert_eq!(parse_ping("ping: connect: Network is unreachable"), None);
        assert_eq!(link_line_name("5: rvh1@if4: <BROADCAST> mtu 1500"), Some("rvh1"));
        assert_eq!(link_line_name("1: lo: <LOOPBACK,UP>"), Some("lo"));
        assert!(check_ifname("rvh123456789012").is_ok());
        assert!(check_ifname("rvh1234567890123").is_err());
        assert!(check_ifname("a/b").is_err());
        assert!(NetNs::new("Bad_Prefix").is_err());
    }

    #[test]
    fn netns_create_configure_and_delete() {
        let started = Instant::now();
        let ns = NetNs::new("rvt").expect("creating a network namespace");
        let name = ns.name().to_owned();
        assert!(name.starts_with("rvt-"), "{name}");
        assert!(ns.path().exists(), "{}", ns.path().display());
        assert!(list_netns().unwrap().contains(&name));
        assert_eq!(ns.ifindex("lo").unwrap(), 1);
        assert_eq!(ns.mac("lo").unwrap(), [0; 6]);
        assert!(ns.ip(&["link", "show", "lo"]).unwrap().contains("UP"), "lo is up");
        ns.sysctl("net.ipv4.ip_forward", "1").unwrap();
        assert_eq!(ns.run(&["sysctl", "-n", "net.ipv4.ip_forward"]).unwrap().trim(), "1");
        assert!(
            ns.sysctl("kernel.hostname", "x").is_err(),
            "non-net sysctls are refused"
        );
        let err = ns.run(&["ip", "link", "show", "nosuchdev"]).unwrap_err().to_string();
        assert!(err.contains("nosuchdev") && err.contains("does not exist"), "{err}");

        // A second namespace never gets the same name.
        let other = NetNs::new("rvt").unwrap();
        assert_ne!(other.name(), name);

        // A process left running in the namespace is killed by the drop.
        let mut sleeper = ns.command("sleep").arg("600").spawn().unwrap();
        eventually("the sleeper is in the namespace", || {
            Command::new("ip")
                .args(["netns", "pids", &name])
                .output()
                .is_ok_and(|o| !o.stdout.is_empty())
        });
        drop(ns);
        let status = sleeper.wait().unwrap();
        assert!(!status.success(), "the sleeper was killed: {status}");
        assert_gone(&[name]);
        eprintln!("netns create/configure/delete: {:?}", started.elapsed());
    }

    #[test]
    fn netns_cleanup_on_panic() {
        let (tx, rx) = std::sync::mpsc::channel();
        let panicked = std::thread::spawn(move || {
            let ns = NetNs::new("rvt").expect("creating a network namespace");
            tx.send(ns.name().to_owned()).unwrap();
            panic!("deliberate panic with namespace {} alive", ns.name());
        })
        .join();
        assert!(panicked.is_err(), "the thread panicked");
        let name = rx.recv().unwrap();
        assert_gone(&[name]);
    }

    #[test]
    fn netns_spawn_in_changes_only_that_thread() {
        let ns = NetNs::new("rvt").unwrap();
        ns.ip(&["addr", "add", "198.18.200.1/32", "dev", "lo"]).unwrap();
        let own = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
        let inside = ns
            .in_ns(|| std::fs::read_link("/proc/thread-self/ns/net").unwrap())
            .unwrap();
        assert_ne!(inside, own);
        assert_eq!(std::fs::read_link("/proc/thread-self/ns/net").unwrap(), own);
        // A socket made inside stays inside: bind an address only the namespace has.
        let listener = ns.in_ns(|| TcpListener::bind("198.18.200.1:0")).unwrap().unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(
            TcpListener::bind("198.18.200.1:0").is_err(),
            "the host does not have 198.18.200.1"
        );
        let client = ns.tcp_stream(addr, WAIT).unwrap();
        let (_server_side, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
    }

    #[test]
    fn netns_veth_pair_between_namespaces() {
        let a = NetNs::new("rvt").unwrap();
        let b = NetNs::new("rvt").unwrap();
        veth_pair(&a, "rvva", &b, "rvvb").unwrap();
        a.ip(&["addr", "add", "198.18.201.1/30", "dev", "rvva"]).unwrap();
        b.ip(&["addr", "add", "198.18.201.2/30", "dev", "rvvb"]).unwrap();
        let stats = a
            .ping("198.18.201.2".parse().unwrap(), 3, Duration::from_millis(10), WAIT)
            .unwrap();
        assert_eq!(
            stats,
            PingStats {
                transmitted: 3,
                received: 3
            }
        );
        assert!(veth_pair(&a, "this-name-is-too-long", &b, "x").is_err());
        // Deleting one namespace removes the pair: its end in the other goes too.
        drop(b);
        eventually("rvva is gone with its peer's namespace", || {
            !a.has_link("rvva").unwrap()
        });
    }

    #[test]
    fn netns_node_pods_ping_dual_stack() {
        let started = Instant::now();
        let node = two_pod_node();
        let setup = started.elapsed();
        let (a, b) = (node.pod("a"), node.pod("b"));
        assert_eq!(a.host_ifname, "rvh1");
        assert_eq!(b.host_ifname, "rvh2");
        assert_eq!(node.ns.ifindex("rvh1").unwrap(), a.host_ifindex);
        assert_eq!(node.ns.mac("rvh2").unwrap(), b.host_mac);
        assert_eq!(b.ns.mac(POD_IFNAME).unwrap(), b.pod_mac);
        // The gateway is nowhere, and there is no proxy ARP.
        let node_addrs = node.ns.ip(&["-o", "addr"]).unwrap();
        assert!(
            !node_addrs.contains("198.18.0.1/") && !node_addrs.contains("2001:2::1/"),
            "{node_addrs}"
        );
        assert!(node_addrs.contains(&node.loopback4.to_string()), "{node_addrs}");
        let neigh = a.ns.ip(&["neigh", "show", "dev", POD_IFNAME]).unwrap();
        assert!(
            neigh.contains(&format!("198.18.0.1 lladdr {} PERMANENT", format_mac(&a.host_mac))),
            "{neigh}"
        );
        let routes = a.ns.ip(&["route"]).unwrap();
        assert!(
            !routes.contains("198.18.0.0/24"),
            "no on-link prefix route in the pod: {routes}"
        );

        let t = Instant::now();
        let (rx_before, _) = node.ns.link_packets("rvh1").unwrap();
        for dst in b.addrs() {
            let stats = a.ping(dst, 5, Duration::from_millis(10), WAIT).unwrap();
            assert_eq!(
                stats,
                PingStats {
                    transmitted: 5,
                    received: 5
                },
                "a -> {dst}"
            );
        }
        for dst in a.addrs() {
            let stats = b.ping(dst, 5, Duration::from_millis(10), WAIT).unwrap();
            assert_eq!(
                stats,
                PingStats {
                    transmitted: 5,
                    received: 5
                },
                "b -> {dst}"
            );
        }
        // Fast pings (root may go below 2 ms): 1000 at 0.2 ms, none lost.
        let fast = a
            .ping(b.ipv4().unwrap(), 1000, Duration::from_micros(200), WAIT)
            .unwrap();
        assert_eq!(fast.lost(), 0, "{fast:?}");
        let pings = t.elapsed();
        // The packets went through the node namespace: a's host veth received them.
        let (rx_after, _) = node.ns.link_packets("rvh1").unwrap();
        assert!(rx_after - rx_before >= 1010, "rvh1 rx {rx_before} -> {rx_after}");
        // Nothing answers for an address no pod has.
        let none = a
            .ping(v4(99).into(), 2, Duration::from_millis(10), Duration::from_millis(300))
            .unwrap();
        assert_eq!(none.received, 0, "{none:?}");
        eprintln!(
            "node+2 pods setup {setup:?}, pings {pings:?}, total {:?}",
            started.elapsed()
        );
    }

    /// Nothing in the node answers ARP/ND for the gateway: without the
    /// datapath or static entries, a pod reaches nobody.
    #[test]
    fn netns_node_gateway_unanswered_without_static_neighbor() {
        let mut node = two_pod_node();
        node.add_pod(PodSpec::new("c", (v4(4), 24), (v6(4), 64)).gateways(v4(1), v6(1)))
            .unwrap();
        let (a, c) = (node.pod("a"), node.pod("c"));
        assert_eq!(c.host_ifname, "rvh3");
        for dst in a.addrs() {
            let stats = c
                .ping(dst, 2, Duration::from_millis(100), Duration::from_millis(500))
                .unwrap();
            assert_eq!(stats.received, 0, "c -> {dst}: {stats:?}");
        }
        let neigh = c.ns.ip(&["neigh", "show", "198.18.0.1"]).unwrap();
        assert!(
            !neigh.contains("lladdr"),
            "nobody answered ARP for the gateway: {neigh}"
        );
        // A reply to c would need c's own neighbour entry for the gateway.
        assert!(
            !a.tcp_connect(SocketAddr::new(c.ipv4().unwrap(), 9), Duration::from_millis(300))
                .unwrap()
        );
    }

    /// Strict reverse-path filtering (a common host default, inherited by
    /// new namespaces for IPv4) does not break the wiring.
    #[test]
    fn netns_node_pods_strict_rp_filter() {
        let node = two_pod_node();
        let strict = [
            ("net.ipv4.conf.all.rp_filter", "1"),
            ("net.ipv4.conf.default.rp_filter", "1"),
        ];
        node.ns.sysctls(&strict).unwrap();
        for pod in node.pods() {
            pod.ns.sysctls(&strict).unwrap();
            pod.ns.sysctl("net.ipv4.conf.eth0.rp_filter", "1").unwrap();
        }
        for iface in ["rvh1", "rvh2"] {
            node.ns
                .sysctl(&format!("net.ipv4.conf.{iface}.rp_filter"), "1")
                .unwrap();
        }
        let (a, b) = (node.pod("a"), node.pod("b"));
        let stats = a.ping(b.ipv4().unwrap(), 5, Duration::from_millis(10), WAIT).unwrap();
        assert_eq!(
            stats,
            PingStats {
                transmitted: 5,
                received: 5
            }
        );
        let server = b.tcp_server(0).unwrap();
        assert!(
            a.tcp_echo(SocketAddr::new(b.ipv4().unwrap(), server.port()), WAIT)
                .unwrap()
        );
    }

    #[test]
    fn netns_node_pods_tcp_udp_echo_dual_stack() {
        let node = two_pod_node();
        let (a, b) = (node.pod("a"), node.pod("b"));
        let t = Instant::now();
        let tcp = b.tcp_server(0).unwrap();
        let udp = b.udp_server(7007).unwrap();
        assert_eq!(udp.port(), 7007);
        for ip in b.addrs() {
            let dst = SocketAddr::new(ip, tcp.port());
            assert!(a.tcp_connect(dst, WAIT).unwrap(), "tcp connect a -> {dst}");
            assert!(a.tcp_echo(dst, WAIT).unwrap(), "tcp echo a -> {dst}");
            let dst = SocketAddr::new(ip, udp.port());
            assert!(a.udp_echo(dst, WAIT).unwrap(), "udp echo a -> {dst}");
        }
        assert_eq!(tcp.connections(), 4);
        assert!(udp.datagrams() >= 2);

        // A connection held open and used later, from another thread.
        let mut stream = a
            .tcp_stream(SocketAddr::new(b.ipv6().unwrap(), tcp.port()), WAIT)
            .unwrap();
        std::thread::spawn(move || {
            stream.set_read_timeout(Some(WAIT)).unwrap();
            stream.write_all(b"later").unwrap();
            let mut back = [0u8; 5];
            stream.read_exact(&mut back).unwrap();
            assert_eq!(&back, b"later");
        })
        .join()
        .unwrap();

        // Nothing listening: refused at once, not an error.
        let closed = SocketAddr::new(b.ipv4().unwrap(), 9);
        assert!(!a.tcp_connect(closed, WAIT).unwrap());
        assert!(!a.udp_echo(closed, WAIT).unwrap());
        // Once the servers are dropped, their ports are closed.
        let port = tcp.port();
        drop(tcp);
        drop(udp);
        assert!(!a.tcp_connect(SocketAddr::new(b.ipv4().unwrap(), port), WAIT).unwrap());
        assert!(
            !a.udp_echo(SocketAddr::new(b.ipv6().unwrap(), 7007), Duration::from_millis(500))
                .unwrap()
        );
        eprintln!("tcp/udp echo checks: {:?}", t.elapsed());
    }

    #[test]
    fn netns_node_drop_removes_namespaces_and_veths() {
        let mut node = two_pod_node();
        let (a, b) = (node.pod("a"), node.pod("b"));
        // Some traffic first, so the drop also has sockets and neighbours to clean.
        let server = b.tcp_server(0).unwrap();
        assert!(
            a.tcp_echo(SocketAddr::new(b.ipv4().unwrap(), server.port()), WAIT)
                .unwrap()
        );
        drop(server);
        assert_eq!(
            a.ping(b.ipv6().unwrap(), 1, Duration::from_millis(10), WAIT)
                .unwrap()
                .received,
            1
        );

        // Removing a pod takes its host veth (and node routes) with it.
        assert!(node.remove_pod("b"));
        assert!(!node.remove_pod("b"));
        eventually("rvh2 is gone", || !node.ns.has_link("rvh2").unwrap());
        let routes = node.ns.ip(&["route"]).unwrap();
        assert!(!routes.contains("198.18.0.3"), "{routes}");

        // An observer namespace linked to the node sees the node's end vanish.
        let observer = NetNs::new("rvt").unwrap();
        veth_pair(&observer, "rvobs", &node.ns, "rvup").unwrap();
        let mut names: Vec<String> = node.pods().iter().map(|p| p.ns.name().to_owned()).collect();
        names.push(node.ns.name().to_owned());
        drop(node);
        assert_gone(&names);
        eventually("the node namespace and its veths are freed", || {
            !observer.has_link("rvobs").unwrap()
        });
    }
}
