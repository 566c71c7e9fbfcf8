//! Supervision: each daemon started, awaited until it answers, restarted with
//! backoff when it exits, and stopped in reverse order.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rivet_common::grpc::{ClientOptions, connect_unix};
use rivet_proto::daemon::v1::{GetInfoRequest, daemon_client::DaemonClient};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{DaemonPhase, DaemonStatus};
use crate::now_unix_nanos;

/// How often readiness is probed.
const READY_POLL: Duration = Duration::from_millis(50);

/// Log lines quoted when a daemon fails to start or crash-loops.
const LOG_TAIL_LINES: usize = 12;

/// How a node daemon is started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSpec {
    /// Daemon name, e.g. `svc-ipam`.
    pub name: String,
    /// Its binary.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Run inside this network namespace (`nsenter --net=<path>`).
    pub netns: Option<PathBuf>,
    /// The socket it answers `GetInfo` on once ready.
    pub socket: PathBuf,
    /// stdout and stderr are appended here.
    pub log: PathBuf,
}

impl DaemonSpec {
    /// Its status before it is first started.
    pub(super) fn pending_status(&self) -> DaemonStatus {
        DaemonStatus {
            name: self.name.clone(),
            pid: None,
            phase: DaemonPhase::Pending,
            restarts: 0,
            started_unix_nanos: 0,
            last_exit: None,
            last_exit_unix_nanos: 0,
            socket: self.socket.clone(),
            log: self.log.clone(),
        }
    }

    /// The command line, program first (`nsenter --net=... -- <program>
    /// ...` for a daemon in a namespace).
    pub fn command_line(&self) -> Vec<OsString> {
        let mut line = Vec::new();
        if let Some(ns) = &self.netns {
            let mut net = OsString::from("--net=");
            net.push(ns);
            line.extend([OsString::from("nsenter"), net, OsString::from("--")]);
        }
        line.push(self.program.clone().into_os_string());
        line.extend(self.args.iter().cloned());
        line
    }

    /// Starts it: own process group, stdin closed, output appended to its log.
    fn spawn(&self) -> std::io::Result<Child> {
        if let Some(dir) = self.log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut log = OpenOptions::new().create(true).append(true).open(&self.log)?;
        let line = self.command_line();
        writeln!(
            log,
            "==== rivet node: starting {} at {}: {}",
            self.name,
            now_unix_nanos() / 1_000_000_000,
            line.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
        )?;
        let mut cmd = Command::new(&line[0]);
        cmd.args(&line[1..])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(false);
        cmd.spawn()
            .map_err(|e| std::io::Error::new(e.kind(), format!("starting {}: {e}", line[0].to_string_lossy())))
    }
}

/// When and how often a daemon that exits is restarted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Delay before the first restart.
    pub initial_backoff: Duration,
    /// The delay doubles per exit up to this.
    pub max_backoff: Duration,
    /// A process that ran this long counts as healthy: its exit starts the
    /// backoff and the crash count over.
    pub healthy_after: Duration,
    /// Exits counted for crash-loop detection are those within this window…
    pub crash_loop_window: Duration,
    /// …and this many of them make a crash loop.
    pub crash_loop_exits: usize,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
            healthy_after: Duration::from_secs(30),
            crash_loop_window: Duration::from_secs(60),
            crash_loop_exits: 5,
        }
    }
}

/// What to do after an exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartDecision {
    /// Wait this long, then restart.
    pub delay: Duration,
    /// The daemon is crash-looping.
    pub crash_loop: bool,
    /// …and this exit made it one (report it once).
    pub entered_crash_loop: bool,
    /// Exits within the window, this one included.
    pub recent_exits: usize,
}

/// The restart policy applied to one daemon's exits (pure: time is given).
#[derive(Debug, Clone)]
pub struct RestartTracker {
    policy: RestartPolicy,
    next_delay: Duration,
    exits: VecDeque<Instant>,
    crash_loop: bool,
}

impl RestartTracker {
    /// A tracker with no exits yet.
    pub fn new(policy: RestartPolicy) -> Self {
        Self {
            next_delay: policy.initial_backoff,
            policy,
            exits: VecDeque::new(),
            crash_loop: false,
        }
    }

    /// Records an exit at `now` of a process that ran `uptime`.
    pub fn on_exit(&mut self, now: Instant, uptime: Duration) -> RestartDecision {
        if uptime >= self.policy.healthy_after {
            self.next_delay = self.policy.initial_backoff;
            self.exits.clear();
            self.crash_loop = false;
        }
        self.exits.push_back(now);
        while let Some(first) = self.exits.front() {
            if now.duration_since(*first) > self.policy.crash_loop_window {
                self.exits.pop_front();
            } else {
                break;
            }
        }
        let delay = self.next_delay;
        self.next_delay = (self.next_delay * 2).min(self.policy.max_backoff);
        let crash_loop = self.exits.len() >= self.policy.crash_loop_exits;
        let entered = crash_loop && !self.crash_loop;
        self.crash_loop = crash_loop;
        RestartDecision {
            delay,
            crash_loop,
            entered_crash_loop: entered,
            recent_exits: self.exits.len(),
        }
    }
}

/// How a readiness wait ended.
enum Readiness {
    Ready,
    Exited(String),
    TimedOut,
    Stopped,
}

/// Called with every daemon's status whenever one changes.
pub type StatusObserver = Arc<dyn Fn(&[DaemonStatus]) + Send + Sync>;

/// What every supervising task shares.
#[derive(Clone)]
struct Shared {
    statuses: Arc<Mutex<Vec<DaemonStatus>>>,
    observer: StatusObserver,
    policy: RestartPolicy,
    ready_timeout: Duration,
    stop_grace: Duration,
}

impl Shared {
    fn update(&self, name: &str, f: impl FnOnce(&mut DaemonStatus)) {
        let snapshot = {
            let mut statuses = self.statuses.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(s) = statuses.iter_mut().find(|s| s.name == name) {
                f(s);
            }
            statuses.clone()
        };
        (self.observer)(&snapshot);
    }
}

/// Starts daemons in order, restarts them when they exit, stops them in
/// reverse order.
///
/// ```no_run
/// # async fn t(specs: Vec<rivet_cli::node::DaemonSpec>) -> anyhow::Result<()> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use rivet_cli::node::{NodeSupervisor, RestartPolicy};
/// let mut supervisor = NodeSupervisor::new(
///     specs,
///     RestartPolicy::default(),
///     Duration::from_secs(30),
///     Duration::from_secs(10),
///     Arc::new(|statuses| eprintln!("{statuses:?}")),
/// );
/// let (_stop_tx, stop) = tokio::sync::watch::channel(false);
/// supervisor.start(&stop).await?;
/// // ... until told to stop:
/// supervisor.stop().await;
/// # Ok(()) }
/// ```
pub struct NodeSupervisor {
    specs: Vec<DaemonSpec>,
    shared: Shared,
    /// Supervising tasks of started daemons, in start order.
    tasks: Vec<(watch::Sender<bool>, JoinHandle<()>)>,
}

impl std::fmt::Debug for NodeSupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSupervisor")
            .field("specs", &self.specs)
            .field("started", &self.tasks.len())
            .finish()
    }
}

impl NodeSupervisor {
    /// A supervisor for `specs` (in start order); nothing runs yet.
    pub fn new(
        specs: Vec<DaemonSpec>,
        policy: RestartPolicy,
        ready_timeout: Duration,
        stop_grace: Duration,
        observer: StatusObserver,
    ) -> Self {
        let statuses = specs.iter().map(DaemonSpec::pending_status).collect();
        Self {
            specs,
            shared: Shared {
                statuses: Arc::new(Mutex::new(statuses)),
                observer,
                policy,
                ready_timeout,
                stop_grace,
            },
            tasks: Vec::new(),
        }
    }

    /// Every daemon's status.
    pub fn statuses(&self) -> Vec<DaemonStatus> {
        self.shared
            .statuses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Starts the daemons in order, each once the previous one answers;
    /// from then on each is supervised. Fails (leaving the started ones
    /// running, for [`stop`](Self::stop)) when one exits or does not answer
    /// in time, or when `cancel` turns true.
    pub async fn start(&mut self, cancel: &watch::Receiver<bool>) -> Result<()> {
        for spec in self.specs.clone() {
            if *cancel.borrow() {
                bail!("interrupted while starting the node");
            }
            let started = Instant::now();
            let mut child = spec.spawn()?;
            let pid = child.id();
            self.shared.update(&spec.name, |s| {
                s.pid = pid;
                s.phase = DaemonPhase::Starting;
                s.started_unix_nanos = now_unix_nanos();
            });
            let mut cancel = cancel.clone();
            match wait_ready(&spec, &mut child, self.shared.ready_timeout, &mut cancel).await {
                Readiness::Ready => {}
                outcome => {
                    terminate(&mut child, self.shared.stop_grace).await;
                    self.shared.update(&spec.name, |s| {
                        s.pid = None;
                        s.phase = DaemonPhase::Stopped;
                    });
                    let why = match outcome {
                        Readiness::Exited(status) => format!("exited while starting ({status})"),
                        Readiness::TimedOut => format!(
                            "did not answer on {} within {}s",
                            spec.socket.display(),
                            self.shared.ready_timeout.as_secs()
                        ),
                        _ => "interrupted while starting".into(),
                    };
                    bail!(
                        "{} {why}; the end of {}:\n{}",
                        spec.name,
                        spec.log.display(),
                        log_tail(&spec.log, LOG_TAIL_LINES)
                    );
                }
            }
            self.shared.update(&spec.name, |s| s.phase = DaemonPhase::Running);
            eprintln!(
                "rivet node: {} is up (pid {}, {} ms)",
                spec.name,
                pid.unwrap_or_default(),
                started.elapsed().as_millis()
            );
            let (stop_tx, stop_rx) = watch::channel(false);
            let task = tokio::spawn(supervise(spec, child, started, self.shared.clone(), stop_rx));
            self.tasks.push((stop_tx, task));
        }
        Ok(())
    }

    /// Stops the started daemons in reverse order: SIGTERM, SIGKILL after
    /// the grace period. A daemon waiting for a restart is not restarted.
    pub async fn stop(&mut self) {
        while let Some((stop, task)) = self.tasks.pop() {
            let _ = stop.send(true);
            let _ = task.await;
        }
    }
}

/// Resolves once `stop` is true (or its sender is gone).
pub(super) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Supervises one running daemon until told to stop.
async fn supervise(
    spec: DaemonSpec,
    mut child: Child,
    mut started: Instant,
    shared: Shared,
    mut stop: watch::Receiver<bool>,
) {
    let mut tracker = RestartTracker::new(shared.policy.clone());
    loop {
        let status = tokio::select! {
            status = child.wait() => status,
            () = stopped(&mut stop) => {
                shared.update(&spec.name, |s| s.phase = DaemonPhase::Stopped);
                terminate(&mut child, shared.stop_grace).await;
                shared.update(&spec.name, |s| s.pid = None);
                eprintln!("rivet node: {} stopped", spec.name);
                return;
            }
        };
        let mut exit = match status {
            Ok(status) => describe_exit(status),
            Err(e) => format!("lost track of it: {e}"),
        };
        // Restart until one answers again, or until told to stop.
        loop {
            let decision = tracker.on_exit(Instant::now(), started.elapsed());
            shared.update(&spec.name, |s| {
                s.pid = None;
                s.phase = if decision.crash_loop {
                    DaemonPhase::CrashLoop
                } else {
                    DaemonPhase::Restarting
                };
                s.restarts += 1;
                s.last_exit = Some(exit.clone());
                s.last_exit_unix_nanos = now_unix_nanos();
            });
            eprintln!(
                "rivet node: {} exited ({exit}) after {:.1}s; restarting in {} ms",
                spec.name,
                started.elapsed().as_secs_f64(),
                decision.delay.as_millis()
            );
            if decision.entered_crash_loop {
                eprintln!(
                    "rivet node: {} is crash-looping: {} exits within {}s; it keeps being restarted \
                     with backoff up to {}s. The end of {}:\n{}",
                    spec.name,
                    decision.recent_exits,
                    shared.policy.crash_loop_window.as_secs(),
                    shared.policy.max_backoff.as_secs(),
                    spec.log.display(),
                    log_tail(&spec.log, LOG_TAIL_LINES)
                );
            }
            tokio::select! {
                () = tokio::time::sleep(decision.delay) => {}
                () = stopped(&mut stop) => {
                    shared.update(&spec.name, |s| s.phase = DaemonPhase::Stopped);
                    eprintln!("rivet node: {} stopped (was waiting to restart)", spec.name);
                    return;
                }
            }
            started = Instant::now();
            let mut next = match spec.spawn() {
                Ok(c) => c,
                Err(e) => {
                    exit = format!("could not start: {e}");
                    continue;
                }
            };
            let pid = next.id();
            shared.update(&spec.name, |s| {
                s.pid = pid;
                s.phase = DaemonPhase::Starting;
                s.started_unix_nanos = now_unix_nanos();
            });
            match wait_ready(&spec, &mut next, shared.ready_timeout, &mut stop).await {
                Readiness::Ready => {
                    shared.update(&spec.name, |s| s.phase = DaemonPhase::Running);
                    eprintln!(
                        "rivet node: {} is up again (pid {}, {} ms)",
                        spec.name,
                        pid.unwrap_or_default(),
                        started.elapsed().as_millis()
                    );
                    child = next;
                    break;
                }
                Readiness::Exited(status) => exit = format!("{status}, while starting"),
                Readiness::TimedOut => {
                    terminate(&mut next, shared.stop_grace).await;
                    exit = format!("not answering within {}s", shared.ready_timeout.as_secs());
                }
                Readiness::Stopped => {
                    shared.update(&spec.name, |s| s.phase = DaemonPhase::Stopped);
                    terminate(&mut next, shared.stop_grace).await;
                    shared.update(&spec.name, |s| s.pid = None);
                    eprintln!("rivet node: {} stopped", spec.name);
                    return;
                }
            }
        }
    }
}

/// Waits until the daemon answers `GetInfo` on its socket with its own pid.
async fn wait_ready(
    spec: &DaemonSpec,
    child: &mut Child,
    timeout: Duration,
    stop: &mut watch::Receiver<bool>,
) -> Readiness {
    let deadline = Instant::now() + timeout;
    let pid = child.id();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Readiness::Exited(describe_exit(status)),
            Ok(None) => {}
            Err(e) => return Readiness::Exited(format!("lost track of it: {e}")),
        }
        if *stop.borrow() {
            return Readiness::Stopped;
        }
        if answering_pid(&spec.socket).await.is_some_and(|p| Some(p) == pid) {
            return Readiness::Ready;
        }
        if Instant::now() >= deadline {
            return Readiness::TimedOut;
        }
        tokio::select! {
            () = tokio::time::sleep(READY_POLL) => {}
            () = stopped(stop) => return Readiness::Stopped,
        }
    }
}

/// The pid of the daemon answering `GetInfo` on `socket`, if one does.
pub(super) async fn answering_pid(socket: &Path) -> Option<u32> {
    if !socket.exists() {
        return None;
    }
    let options = ClientOptions {
        connect_timeout: Duration::ZERO,
        request_timeout: Duration::from_secs(1),
        ..ClientOptions::default()
    };
    let channel = connect_unix(socket, &options).await.ok()?;
    let info = DaemonClient::new(channel).get_info(GetInfoRequest {}).await.ok()?;
    Some(info.into_inner().pid)
}

/// SIGTERM, then SIGKILL after `grace`; reaps the child.
async fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    }
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
}

/// `exit status 1`, `signal 9 (SIGKILL)`.
pub(super) fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => match Signal::try_from(signal) {
            Ok(s) => format!("signal {signal} ({})", s.as_str()),
            Err(_) => format!("signal {signal}"),
        },
        _ => status.to_string(),
    }
}

/// The last `n` lines of a log file, indented, for messages.
pub fn log_tail(path: &Path, n: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            let tail = &lines[lines.len().saturating_sub(n)..];
            if tail.is_empty() {
                "  (empty)".into()
            } else {
                tail.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
            }
        }
        Err(e) => format!("  (cannot read it: {e})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RestartPolicy {
        RestartPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
            healthy_after: Duration::from_secs(10),
            crash_loop_window: Duration::from_secs(60),
            crash_loop_exits: 3,
        }
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_resets_after_a_healthy_run() {
        let mut t = RestartTracker::new(policy());
        let t0 = Instant::now();
        let quick = Duration::from_millis(10);
        let delays: Vec<u128> = (0..6)
            .map(|i| t.on_exit(t0 + Duration::from_secs(i * 100), quick).delay.as_millis())
            .collect();
        // 100 s apart: never a crash loop, but quick exits keep backing off.
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        // A run longer than healthy_after starts over.
        let d = t.on_exit(t0 + Duration::from_secs(1000), Duration::from_secs(11));
        assert_eq!(d.delay, Duration::from_millis(100));
        assert_eq!(d.recent_exits, 1);
    }

    #[test]
    fn crash_loop_is_reported_once_and_ends_after_a_healthy_run() {
        let mut t = RestartTracker::new(policy());
        let t0 = Instant::now();
        let quick = Duration::from_millis(10);
        let d1 = t.on_exit(t0, quick);
        let d2 = t.on_exit(t0 + Duration::from_secs(1), quick);
        assert!(!d1.crash_loop && !d2.crash_loop);
        let d3 = t.on_exit(t0 + Duration::from_secs(2), quick);
        assert!(d3.crash_loop && d3.entered_crash_loop);
        assert_eq!(d3.recent_exits, 3);
        let d4 = t.on_exit(t0 + Duration::from_secs(3), quick);
        assert!(d4.crash_loop && !d4.entered_crash_loop, "reported once");
        // Exits older than the window no longer count.
        let d5 = t.on_exit(t0 + Duration::from_secs(200), quick);
        assert!(!d5.crash_loop);
        assert_eq!(d5.recent_exits, 1);
        // A healthy run clears it as well.
        for i in 0..3 {
            t.on_exit(t0 + Duration::from_secs(201 + i), quick);
        }
        let healthy = t.on_exit(t0 + Duration::from_secs(300), Duration::from_secs(60));
        assert!(!healthy.crash_loop);
    }

    #[test]
    fn exits_are_described() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            describe_exit(std::process::ExitStatus::from_raw(1 << 8)),
            "exit status 1"
        );
        assert_eq!(
            describe_exit(std::process::ExitStatus::from_raw(9)),
            "signal 9 (SIGKILL)"
        );
    }

    /// The supervisor with `sh` scripts standing in for daemons: a fake
    /// daemon is "ready" once its socket answers, so here readiness is
    /// checked against a real (tiny) gRPC daemon only in tests/node.rs;
    /// this checks start failures and their messages.
    #[tokio::test]
    async fn a_daemon_that_exits_while_starting_fails_the_start_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let spec = DaemonSpec {
            name: "fake".into(),
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "echo cannot bind the socket >&2; exit 3".into()],
            netns: None,
            socket: dir.path().join("fake.sock"),
            log: dir.path().join("fake.log"),
        };
        let seen = Arc::new(Mutex::new(Vec::new()));
        let observer: StatusObserver = {
            let seen = Arc::clone(&seen);
            Arc::new(move |s: &[DaemonStatus]| seen.lock().unwrap().push(s[0].phase))
        };
        let mut supervisor = NodeSupervisor::new(
            vec![spec],
            RestartPolicy::default(),
            Duration::from_secs(5),
            Duration::from_secs(1),
            observer,
        );
        let (_tx, cancel) = watch::channel(false);
        let err = supervisor.start(&cancel).await.unwrap_err().to_string();
        assert!(err.contains("fake exited while starting (exit status 3)"), "{err}");
        assert!(err.contains("cannot bind the socket"), "{err}");
        assert_eq!(*seen.lock().unwrap(), [DaemonPhase::Starting, DaemonPhase::Stopped]);
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn a_daemon_that_never_answers_times_out_and_is_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let spec = DaemonSpec {
            name: "mute".into(),
            program: "/bin/sleep".into(),
            args: vec!["30".into()],
            netns: None,
            socket: dir.path().join("mute.sock"),
            log: dir.path().join("mute.log"),
        };
        let mut supervisor = NodeSupervisor::new(
            vec![spec],
            RestartPolicy::default(),
            Duration::from_millis(300),
            Duration::from_secs(1),
            Arc::new(|_: &[DaemonStatus]| {}),
        );
        let (_tx, cancel) = watch::channel(false);
        let started = Instant::now();
        let err = supervisor.start(&cancel).await.unwrap_err().to_string();
        assert!(err.contains("did not answer"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let status = &supervisor.statuses()[0];
        assert_eq!(status.phase, DaemonPhase::Stopped);
        assert!(status.pid.is_none());
        // The log has the start marker with the command line.
        let log = std::fs::read_to_string(dir.path().join("mute.log")).unwrap();
        assert!(log.contains("starting mute") && log.contains("/bin/sleep 30"), "{log}");
    }
}
