//! `cargo xtask demo`: show what Rivet does, using only the real binaries.
//!
//! For now (until the full node exists) the demo runs svc-ipam on a temp socket and
//! state dir and drives it through the `rivet` CLI: allocation, idempotency, durability
//! across `kill -9`, release and graceful shutdown. Later issues grow this module into
//! the single-node demo. Nothing here touches the machine's real network or state: all
//! files live in a temp dir that is removed at the end, and the daemon is killed if the
//! demo fails half-way (both by guards, so an error anywhere cleans up).

use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::cmd;

/// How long a (re)started daemon may take until `rivet status` succeeds.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long svc-ipam may take to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How often readiness and exit are polled.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Lines of the daemon's log quoted when it fails.
const LOG_TAIL_LINES: usize = 20;
/// Longest Unix socket path the kernel accepts (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The node name svc-ipam is started with.
const NODE_NAME: &str = "demo-node";
/// The demo pool: tiny ranges from the benchmarking blocks (DESIGN.md §8), so nothing
/// can clash with real addresses.
const POOL: &str = "default=198.18.0.0/28,2001:2::/124";

/// Builds the binaries and runs the demo.
pub fn run() -> Result<()> {
    cmd::run(cmd::cargo().args(["build", "--workspace", "--bins"]))?;
    let bin_dir = cmd::target_dir().join("debug");
    let svc_ipam = built_binary(&bin_dir, "svc-ipam", "svc-ipam")?;
    let rivet = built_binary(&bin_dir, "rivet", "cli")?;

    let tmp = TempDir::create("rivet-demo")?;
    let demo = Demo {
        svc_ipam,
        rivet,
        sockets: tmp.path().join("sockets"),
        state: tmp.path().join("state"),
        log: tmp.path().join("svc-ipam.log"),
    };
    demo.check_socket_path()?;
    demo.run()?;
    println!();
    println!("# Demo finished; removing {}", tmp.path().display());
    Ok(())
}

/// The path of a binary that `cargo build --workspace --bins` should have produced,
/// or an error that says which crate was expected to provide it.
fn built_binary(bin_dir: &Path, name: &str, crate_dir: &str) -> Result<PathBuf> {
    let path = bin_dir.join(name);
    if !path.is_file() {
        bail!(
            "the demo needs the `{name}` binary, but `cargo build --workspace --bins` did not \
             produce {}: is the {crate_dir}/ crate a workspace member with a `{name}` binary?",
            path.display()
        );
    }
    Ok(path)
}

/// Paths of one demo run.
struct Demo {
    svc_ipam: PathBuf,
    rivet: PathBuf,
    sockets: PathBuf,
    state: PathBuf,
    /// svc-ipam's stdout and stderr (kept out of the demo's own output; quoted on failure).
    log: PathBuf,
}

impl Demo {
    /// The demo proper: each step prints a `# ` line saying what it shows, then the
    /// command and its output.
    fn run(&self) -> Result<()> {
        explain(&format!(
            "Start svc-ipam with pool {POOL}; its socket and state live in a temp dir."
        ));
        let mut daemon = self.start()?;

        self.show(
            "svc-ipam is up. `rivet status` shows each daemon socket: reachable, boot_id, version.",
            &["status"],
        )?;
        self.show(
            "Allocate an IPv4 address for pod-a's eth0. The network address, the gateway \
             (first host) and the broadcast address are never handed out.",
            &ipam_allocate("pod-a", "ipv4"),
        )?;
        self.show(
            "Allocate an IPv6 address for the same interface (dual stack).",
            &ipam_allocate("pod-a", "ipv6"),
        )?;
        self.show(
            "Ask again for pod-a's IPv4 address: the same owner gets the same address \
             (Allocate is idempotent, so a retried CNI ADD is harmless).",
            &ipam_allocate("pod-a", "ipv4"),
        )?;
        self.show(
            "Allocate for pod-b: another owner gets another address.",
            &ipam_allocate("pod-b", "ipv4"),
        )?;
        self.show(
            "List the allocations and the pool's usage.",
            &["ipam", "list", "--allocations"],
        )?;

        explain(
            "Kill svc-ipam with SIGKILL (no chance to clean up) and start it again: an \
             allocation is acknowledged only once it is durable on disk, so none is lost.",
        );
        let status = daemon.kill_hard()?;
        println!("svc-ipam (pid {}) killed: {status}", daemon.pid());
        daemon = self.start()?;

        self.show(
            "The restarted svc-ipam has a new boot_id (compare with the first `rivet \
             status`): that is how its clients notice a restart and resync.",
            &["status"],
        )?;
        self.show(
            "The same allocations as before the kill.",
            &["ipam", "list", "--allocations"],
        )?;
        self.show(
            "Release what pod-a's eth0 holds (Release is idempotent too).",
            &["ipam", "release", "--container-id", "pod-a", "--interface", "eth0"],
        )?;
        self.show(
            "pod-a's addresses are free again; pod-b keeps its address.",
            &["ipam", "list", "--allocations"],
        )?;

        explain("Stop svc-ipam with SIGTERM: it shuts down gracefully.");
        let status = daemon.terminate(STOP_TIMEOUT)?;
        if !status.success() {
            bail!(
                "svc-ipam did not exit cleanly after SIGTERM ({status}); its log:\n{}",
                self.log_tail()
            );
        }
        println!("svc-ipam (pid {}) exited cleanly ({status})", daemon.pid());
        Ok(())
    }

    /// Starts svc-ipam (appending to the same log across restarts) and waits until
    /// `rivet status` succeeds against it.
    fn start(&self) -> Result<Daemon> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let mut command = Command::new(&self.svc_ipam);
        command
            .arg("--socket-dir")
            .arg(&self.sockets)
            .arg("--state-dir")
            .arg(&self.state)
            .args(["--node-name", NODE_NAME, "--pool", POOL]);
        let mut daemon = Daemon::spawn(command, log)?;
        println!(
            "svc-ipam started (pid {}), waiting for `rivet status` to succeed",
            daemon.pid()
        );
        self.wait_ready(&mut daemon)?;
        Ok(daemon)
    }

    /// Polls `rivet status` until it succeeds, failing early if the daemon exits and
    /// after [`READY_TIMEOUT`] otherwise, quoting the daemon's log either way.
    fn wait_ready(&self, daemon: &mut Daemon) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = daemon.try_wait()? {
                bail!(
                    "svc-ipam exited while starting ({status}); its log:\n{}",
                    self.log_tail()
                );
            }
            let mut status = self.rivet(&["status"]);
            let output = status
                .output()
                .with_context(|| format!("could not run {}", self.rivet.display()))?;
            if output.status.success() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "svc-ipam not ready after {} s: `{}` still fails ({}): {}\nsvc-ipam's log:\n{}",
                    READY_TIMEOUT.as_secs(),
                    cmd::display(&status),
                    output.status,
                    cmd::tail_lines(&String::from_utf8_lossy(&output.stderr), 5),
                    self.log_tail()
                );
            }
            sleep(POLL_INTERVAL);
        }
    }

    /// Prints the explanation, then runs `rivet <args>` with its output shown.
    fn show(&self, explanation: &str, args: &[&str]) -> Result<()> {
        explain(explanation);
        cmd::run(&mut self.rivet(args))
    }

    /// A `rivet` CLI command against the demo's socket dir.
    fn rivet(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.rivet);
        command.arg("--socket-dir").arg(&self.sockets).args(args);
        command
    }

    /// The last lines of svc-ipam's log, for error messages.
    fn log_tail(&self) -> String {
        match fs::read_to_string(&self.log) {
            Ok(text) if text.trim().is_empty() => "(empty)".to_string(),
            Ok(text) => cmd::tail_lines(&text, LOG_TAIL_LINES),
            Err(err) => format!("(could not read {}: {err})", self.log.display()),
        }
    }

    /// Fails early with a clear message if the temp dir is so deep that svc-ipam's
    /// socket path would exceed the kernel's limit.
    fn check_socket_path(&self) -> Result<()> {
        let socket = self.sockets.join("svc-ipam.sock");
        let len = socket.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            bail!(
                "the demo's socket path {} is {len} bytes, over the {MAX_SOCKET_PATH}-byte limit \
                 of Unix socket paths: set TMPDIR to a shorter directory, e.g. TMPDIR=/tmp",
                socket.display()
            );
        }
        Ok(())
    }
}

/// `ipam allocate` arguments for `<container_id>`'s eth0.
fn ipam_allocate<'a>(container_id: &'a str, family: &'a str) -> [&'a str; 8] {
    [
        "ipam",
        "allocate",
        "--container-id",
        container_id,
        "--interface",
        "eth0",
        "--family",
        family,
    ]
}

/// Prints a step's one-line explanation, set off by a blank line.
fn explain(text: &str) {
    println!();
    println!("# {text}");
}

/// A running daemon, killed with SIGKILL and reaped when dropped unless it already
/// exited, so no daemon outlives the demo, whatever error ends it.
struct Daemon {
    child: Child,
}

impl Daemon {
    /// Spawns `command` with stdin closed and stdout and stderr going to `log`.
    fn spawn(mut command: Command, log: File) -> Result<Self> {
        let log_for_stdout = log.try_clone().context("duplicating the log file handle")?;
        command.stdin(Stdio::null()).stdout(log_for_stdout).stderr(log);
        println!("$ {} &", cmd::display(&command));
        let child = command
            .spawn()
            .with_context(|| format!("could not start {}", Path::new(command.get_program()).display()))?;
        Ok(Self { child })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the daemon has exited.
    fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        self.child
            .try_wait()
            .with_context(|| format!("checking on pid {}", self.pid()))
    }

    /// `kill -9`, then reap it.
    fn kill_hard(&mut self) -> Result<ExitStatus> {
        self.child
            .kill()
            .with_context(|| format!("sending SIGKILL to pid {}", self.pid()))?;
        self.child
            .wait()
            .with_context(|| format!("waiting for pid {}", self.pid()))
    }

    /// Sends SIGTERM and waits up to `timeout` for the daemon to exit. On timeout it is
    /// left running for the drop guard to SIGKILL.
    fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus> {
        // The child is not reaped yet, so its pid cannot have been reused.
        let pid = Pid::from_raw(i32::try_from(self.pid()).context("pid out of range")?);
        kill(pid, Signal::SIGTERM).with_context(|| format!("sending SIGTERM to pid {pid}"))?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!("pid {pid} still running {} s after SIGTERM", timeout.as_secs());
            }
            sleep(POLL_INTERVAL);
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A fresh directory under the system temp dir, removed with everything in it when
/// dropped.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `<tmp>/<prefix>.<pid>.<n>` with the first free `n`; short, so socket
    /// paths inside stay well under the kernel's limit.
    fn create(prefix: &str) -> Result<Self> {
        let base = std::env::temp_dir();
        for n in 0..100 {
            let path = base.join(format!("{prefix}.{}.{n}", std::process::id()));
            match fs::create_dir(&path) {
                Ok(()) => return Ok(Self { path }),
                Err(err) if err.kind() == ErrorKind::AlreadyExists => continue,
                Err(err) => {
                    return Err(err).with_context(|| format!("creating {}", path.display()));
                }
            }
        }
        bail!("could not find a free temp dir name under {}", base.display())
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(err) = fs::remove_dir_all(&self.path) {
            eprintln!("warning: could not remove {}: {err}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_dir_is_removed_on_drop() {
        let tmp = TempDir::create("rivet-xtask-test").unwrap();
        let path = tmp.path().to_path_buf();
        fs::create_dir_all(path.join("sockets/nested")).unwrap();
        fs::write(path.join("sockets/nested/file"), "x").unwrap();
        drop(tmp);
        assert!(!path.exists());
    }

    #[test]
    fn dropped_daemon_is_killed_and_reaped() {
        let log = TempDir::create("rivet-xtask-test").unwrap();
        let daemon = Daemon::spawn(
            {
                let mut sleep = Command::new("sleep");
                sleep.arg("60");
                sleep
            },
            File::create(log.path().join("log")).unwrap(),
        )
        .unwrap();
        let pid = Pid::from_raw(i32::try_from(daemon.pid()).unwrap());
        drop(daemon);
        // Reaped: the pid no longer exists (signal 0 only checks).
        assert!(kill(pid, None).is_err());
    }

    #[test]
    fn terminate_reports_the_exit_status() {
        let log = TempDir::create("rivet-xtask-test").unwrap();
        let mut daemon = Daemon::spawn(
            {
                let mut sh = Command::new("sh");
                sh.args(["-c", "trap 'exit 0' TERM; while :; do sleep 0.05; done"]);
                sh
            },
            File::create(log.path().join("log")).unwrap(),
        )
        .unwrap();
        // Give the shell time to install its trap.
        sleep(Duration::from_millis(300));
        let status = daemon.terminate(Duration::from_secs(5)).unwrap();
        assert!(status.success(), "{status}");
    }

    #[test]
    fn missing_binary_names_the_crate() {
        let tmp = TempDir::create("rivet-xtask-test").unwrap();
        let err = built_binary(tmp.path(), "svc-ipam", "svc-ipam")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`svc-ipam` binary"), "{err}");
        assert!(err.contains("svc-ipam/ crate"), "{err}");
    }
}
