//! Daemon processes under test: the real binary, started with its own socket
//! and log file, ready once it answers `GetInfo`, killed on drop.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rivet_proto::daemon::v1::{DaemonInfo, GetInfoRequest, daemon_client::DaemonClient};

use crate::grpc::{ClientOptions, connect_unix};

/// How to start a daemon binary; reusable for restarts.
///
/// ```no_run
/// # async fn t() -> std::io::Result<()> {
/// use rivet_common::testing::DaemonCommand;
/// let dir = tempfile::tempdir()?;
/// let mut daemon = DaemonCommand::new("target/debug/svc-ipam", dir.path().join("svc-ipam.sock"))
///     .args(["--socket-dir", dir.path().to_str().unwrap(), "--pool", "default=198.18.0.0/24"])
///     .spawn()
///     .await?;
/// daemon.kill9();
/// daemon.restart().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DaemonCommand {
    bin: PathBuf,
    socket: PathBuf,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    log: Option<PathBuf>,
    ready_timeout: Duration,
}

impl DaemonCommand {
    /// Runs `bin`; it is ready when `socket` answers `GetInfo`.
    pub fn new(bin: impl Into<PathBuf>, socket: impl Into<PathBuf>) -> Self {
        Self {
            bin: bin.into(),
            socket: socket.into(),
            args: Vec::new(),
            envs: Vec::new(),
            log: None,
            ready_timeout: Duration::from_secs(15),
        }
    }

    /// Adds one argument.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets an environment variable for the daemon.
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs.push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Appends stdout and stderr to `path` (default: next to the socket,
    /// `<socket>.log`).
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = Some(path.into());
        self
    }

    fn log_path(&self) -> PathBuf {
        self.log.clone().unwrap_or_else(|| {
            let mut name = self.socket.file_name().unwrap_or_default().to_os_string();
            name.push(".log");
            self.socket.with_file_name(name)
        })
    }

    fn command(&self) -> std::io::Result<Command> {
        let log = self.log_path();
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let out = File::options().create(true).append(true).open(&log)?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        Ok(cmd)
    }

    /// Starts the daemon and waits until it answers; an early exit or a
    /// timeout is an error quoting the end of its log.
    pub async fn spawn(&self) -> std::io::Result<DaemonProcess> {
        let child = self
            .command()?
            .spawn()
            .map_err(|e| std::io::Error::new(e.kind(), format!("starting {}: {e}", self.bin.display())))?;
        let mut process = DaemonProcess {
            command: self.clone(),
            child: Some(child),
            info: None,
        };
        process.wait_ready().await?;
        Ok(process)
    }

    /// Runs the daemon expecting it to exit by itself (e.g. refused
    /// configuration) within `timeout`; returns its output.
    pub fn run_to_exit(&self, timeout: Duration) -> std::io::Result<Output> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn()?;
        let started = Instant::now();
        loop {
            if child.try_wait()?.is_some() {
                return child.wait_with_output();
            }
            if started.elapsed() > timeout {
                let _ = child.kill();
                let out = child.wait_with_output()?;
                return Err(std::io::Error::other(format!(
                    "{} did not exit within {timeout:?}; stderr: {}",
                    self.bin.display(),
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A running daemon process. Dropping it kills it (SIGKILL) and reaps it.
#[derive(Debug)]
pub struct DaemonProcess {
    command: DaemonCommand,
    child: Option<Child>,
    info: Option<DaemonInfo>,
}

impl DaemonProcess {
    /// What the daemon answered when it became ready.
    pub fn info(&self) -> &DaemonInfo {
        self.info.as_ref().expect("a spawned daemon answered GetInfo")
    }

    /// Its pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.command.log_path()).unwrap_or_default()
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.command.socket
    }

    /// SIGKILL and reap: a crash at an arbitrary moment.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait up to 15 s for a graceful exit; returns its status.
    pub async fn terminate(&mut self) -> std::io::Result<ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| std::io::Error::other("daemon is not running"))?;
        kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).map_err(std::io::Error::from)?;
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if started.elapsed() > Duration::from_secs(15) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::other("daemon ignored SIGTERM for 15 s; killed"));
            }
            // Async sleep: clients in this runtime must be able to close
            // their connections for the daemon to finish draining.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Starts the same command again (after kill9 or terminate) and waits
    /// until it answers.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.kill9();
        self.child = Some(self.command.command()?.spawn()?);
        self.wait_ready().await
    }

    /// [`restart`](Self::restart) with its arguments changed by `edit`
    /// first (a flag added, changed or removed), kept for later restarts.
    pub async fn restart_with_args(&mut self, edit: impl FnOnce(&mut Vec<OsString>)) -> std::io::Result<()> {
        edit(&mut self.command.args);
        self.restart().await
    }

    async fn wait_ready(&mut self) -> std::io::Result<()> {
        let started = Instant::now();
        let deadline = self.command.ready_timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                self.child = None;
                return Err(std::io::Error::other(format!(
                    "{} exited during start-up ({status}); log:\n{}",
                    self.command.bin.display(),
                    super::last_lines(&self.log(), 40)
                )));
            }
            let options = ClientOptions {
                connect_timeout: Duration::from_millis(100),
                request_timeout: Duration::from_secs(2),
                ..ClientOptions::default()
            };
            if let Ok(channel) = connect_unix(&self.command.socket, &options).await
                && let Ok(info) = DaemonClient::new(channel).get_info(GetInfoRequest {}).await
            {
                let info = info.into_inner();
                // A previous instance's socket may still answer during a restart.
                if info.pid == self.pid().unwrap_or_default() {
                    self.info = Some(info);
                    return Ok(());
                }
            }
            if started.elapsed() > deadline {
                self.kill9();
                return Err(std::io::Error::other(format!(
                    "{} did not answer on {} within {deadline:?}; log:\n{}",
                    self.command.bin.display(),
                    self.command.socket.display(),
                    super::last_lines(&self.log(), 40)
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
