//! A cgroup v2 directory owned by a test (socket-level load balancing is
//! attached to one) and processes started inside it; plus the socket probe,
//! a small client run inside it that reports what its sockets see.
//!
//! The directory is `<cgroup2 mount>/rivet-test-<pid>-<n>`, removed on drop
//! (its processes must have exited: tests wait for them). A process joins it
//! between fork and exec by writing `0` to `cgroup.procs` (the kernel moves
//! the writer), so its first socket is already the cgroup's: no race with a
//! pid moved from outside.

use std::ffi::CString;
use std::io;
use std::net::SocketAddr;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use rivet_common::testing::netns::NetNs;

static CGROUPS: AtomicU32 = AtomicU32::new(0);

/// The cgroup2 mount point (`/sys/fs/cgroup` on a unified host,
/// `/sys/fs/cgroup/unified` on a hybrid one), from /proc/self/mountinfo.
pub fn cgroup2_mount() -> io::Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    mountinfo
        .lines()
        .find_map(|line| {
            // `<id> <parent> <dev> <root> <mount point> <options> ... - <fstype> <source> <super options>`
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split_whitespace().nth(4)?;
            (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount_point))
        })
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no cgroup2 file system is mounted"))
}

/// A cgroup v2 directory of the test's, removed on drop.
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    /// Creates `<cgroup2 mount>/rivet-test-<pid>-<n>`.
    pub fn new() -> io::Result<Self> {
        let path = cgroup2_mount()?.join(format!(
            "rivet-test-{}-{}",
            std::process::id(),
            CGROUPS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&path)?;
        Ok(Self { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes `command`'s process join this cgroup before it execs.
    pub fn join_on_exec(&self, command: &mut Command) -> io::Result<()> {
        let procs = CString::new(self.path.join("cgroup.procs").as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in the cgroup path"))?;
        // SAFETY: the closure runs in the forked child before exec and makes
        // only async-signal-safe calls (open, write, close) on memory
        // allocated before the fork.
        unsafe {
            command.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let error = io::Error::last_os_error();
                libc::close(fd);
                if written != 1 {
                    return Err(error);
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// The pids in the cgroup now.
    pub fn pids(&self) -> io::Result<Vec<u32>> {
        Ok(std::fs::read_to_string(self.path.join("cgroup.procs"))?
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect())
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir(&self.path)
            && e.kind() != io::ErrorKind::NotFound
        {
            eprintln!("removing test cgroup {}: {e}", self.path.display());
        }
    }
}

/// The socket probe: Python's socket module (Debian's /usr/bin/python3) is the
/// smallest client that shows what getpeername and recvfrom return.
const PROBE: &str = r#"
import errno, socket, sys, time
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
def show(a):
    return f"{a[0]}:{a[1]}" if fam == socket.AF_INET else f"[{a[0]}]:{a[1]}"
def cookie(s):
    return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, 57, 8), "little")  # SO_COOKIE
try:
    if mode == "tcp":
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect((host, port))
        print("peer", show(s.getpeername()))
        print("cookie", cookie(s))
        s.sendall(b"hello\n")
        print("reply", s.recv(100).decode().strip())
    elif mode == "udp":
        s = socket.socket(fam, socket.SOCK_DGRAM)
        s.settimeout(5)
        s.sendto(b"hello", (host, port))
        print("cookie", cookie(s))
        data, src = s.recvfrom(100)
        print("from", show(src))
        print("reply", data.decode().strip())
    elif mode == "connects":
        n = int(sys.argv[4])
        lat = []
        start = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.connect((host, port))
            s.close()
            lat.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        lat.sort()
        print("connects", n)
        print("seconds", total)
        print("p50_us", lat[n // 2] * 1e6)
        print("p90_us", lat[min(n - 1, n * 90 // 100)] * 1e6)
        print("p99_us", lat[min(n - 1, n * 99 // 100)] * 1e6)
        print("over_100ms", sum(1 for x in lat if x > 0.1))
except OSError as e:
    print("error", errno.errorcode.get(e.errno, str(e.errno)))
"#;

/// What one run of the socket probe printed (`key value` lines).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProbeReport {
    lines: Vec<(String, String)>,
}

impl ProbeReport {
    /// The value printed for `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.lines.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The value of `key` as a socket address (`peer`, `from`).
    pub fn addr(&self, key: &str) -> Option<SocketAddr> {
        self.get(key)?.parse().ok()
    }

    /// The value of `key` as a number (`cookie`, `seconds`, `p50_us`).
    pub fn number(&self, key: &str) -> Option<f64> {
        self.get(key)?.parse().ok()
    }

    /// The errno name the probe failed with (`ECONNREFUSED`), if any.
    pub fn error(&self) -> Option<&str> {
        self.get("error")
    }
}

/// Which probe to run against `target`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// Connect, getpeername, one request and its reply.
    Tcp,
    /// One datagram with sendto, the reply with recvfrom (its source).
    Udp,
    /// `n` sequential connects (closed with RST), timed: `seconds`,
    /// `p50_us`, `p90_us`, `p99_us` and `over_100ms` (connects that waited
    /// for a SYN retransmission).
    Connects(u32),
}

/// Runs the socket probe in `ns` against `target`, inside `cgroup` if given
/// (else in the test's own cgroup), and waits for it (at most `timeout`).
pub fn run_probe(
    ns: &NetNs,
    cgroup: Option<&TestCgroup>,
    probe: Probe,
    target: SocketAddr,
    timeout: Duration,
) -> io::Result<ProbeReport> {
    let mut command = ns.command("/usr/bin/python3");
    let mode = match probe {
        Probe::Tcp => "tcp",
        Probe::Udp => "udp",
        Probe::Connects(_) => "connects",
    };
    command
        .args(["-c", PROBE, mode, &target.ip().to_string(), &target.port().to_string()])
        .stdin(std::process::Stdio::null());
    if let Probe::Connects(n) = probe {
        command.arg(n.to_string());
    }
    if let Some(cgroup) = cgroup {
        cgroup.join_on_exec(&mut command)?;
    }
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let output = match rx.recv_timeout(timeout) {
        Ok(output) => output?,
        Err(_) => {
            // SAFETY: kill(2) of our own child's pid, not yet reaped (the
            // waiting thread reaps it after this signal).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            let _ = rx.recv();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the socket probe ({mode} {target}) did not finish within {timeout:?}"),
            ));
        }
    };
    if !output.status.success() {
        return Err(io::Error::other(format!(
            "the socket probe ({mode} {target}) failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    let lines = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect();
    Ok(ProbeReport { lines })
}
