//! rivet-operator under test: the built binary as a process, with the
//! `rivet-operator` ServiceAccount of `deploy/rbac/rivet-operator.yaml`
//! (so its RBAC is tested, not assumed), metrics on a free port of
//! 127.0.0.1, its log in a temp dir; killed on drop.
//!
//! Each start gets its own `--leader-election-identity`
//! (`operator-<pid>-<n>`), as a real restart gets a new random one, and
//! [`Operator::wait_leading`] waits on the Lease itself (a watch) until
//! that identity holds it. The fixture watches the default Lease
//! (`kube-system/rivet-operator`).
//!
//! ```no_run
//! # async fn t() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use rivet_testkit::kube::KubeApiServer;
//! use rivet_testkit::operator::Operator;
//!
//! let server = KubeApiServer::start().await?;
//! server.apply_crds().await?;
//! let access = server.service_account_client("rivet-operator").await?;
//! let mut a = Operator::start(&access, &["--leader-election-retry-period", "1s"]).await?;
//! a.wait_leading(Duration::from_secs(30)).await?;
//! a.kill9();
//! # Ok(()) }
//! ```

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use kube::runtime::wait::await_condition;
use rivet_common::testing::{free_local_port, http_get, last_lines, metric_sample, read_log, workspace_binary};

use crate::kube::ServiceAccountAccess;

/// The Lease the fixture watches (the operator's defaults).
pub const LEASE_NAMESPACE: &str = "kube-system";
/// See [`LEASE_NAMESPACE`].
pub const LEASE_NAME: &str = "rivet-operator";
/// How long a start may take until `/healthz` answers 200.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long [`Operator::stop`] waits for the process to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

static STARTS: AtomicU32 = AtomicU32::new(0);

/// A running rivet-operator; see the module docs.
#[derive(Debug)]
pub struct Operator {
    bin: PathBuf,
    kubeconfig: PathBuf,
    args: Vec<String>,
    leases: Api<Lease>,
    dir: tempfile::TempDir,
    child: Option<Child>,
    identity: String,
    metrics: SocketAddr,
}

impl Operator {
    /// Starts the workspace's `rivet-operator` with `access` (its
    /// kubeconfig) and `args`, and waits until `/healthz` answers.
    pub async fn start(access: &ServiceAccountAccess, args: &[&str]) -> std::io::Result<Self> {
        Self::start_binary(workspace_binary("rivet-operator"), access, args).await
    }

    /// [`Operator::start`] with the binary at `bin` (a benchmark's build).
    pub async fn start_binary(bin: PathBuf, access: &ServiceAccountAccess, args: &[&str]) -> std::io::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("rivet-operator-{}-", std::process::id()))
            .tempdir()?;
        let mut operator = Self {
            bin,
            kubeconfig: access.kubeconfig.clone(),
            args: args.iter().map(ToString::to_string).collect(),
            leases: Api::namespaced(access.client.clone(), LEASE_NAMESPACE),
            dir,
            child: None,
            identity: String::new(),
            metrics: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        };
        operator.spawn().await?;
        Ok(operator)
    }

    async fn spawn(&mut self) -> std::io::Result<()> {
        self.kill9();
        let n = STARTS.fetch_add(1, Ordering::Relaxed);
        self.identity = format!("operator-{}-{n}", std::process::id());
        self.metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_local_port()));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new(&self.bin)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--leader-election-identity", &self.identity])
            .args(["--metrics-address", &self.metrics.to_string()])
            .args(&self.args)
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| std::io::Error::new(e.kind(), format!("starting {}: {e}", self.bin.display())))?;
        self.child = Some(child);
        self.wait_healthy().await
    }

    async fn wait_healthy(&mut self) -> std::io::Result<()> {
        let started = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                self.child = None;
                return Err(std::io::Error::other(format!(
                    "rivet-operator exited during start-up ({status}); log:\n{}",
                    last_lines(&self.log(), 40)
                )));
            }
            if let Ok(response) = http_get(self.metrics, "/healthz").await
                && response.starts_with("HTTP/1.1 200")
            {
                return Ok(());
            }
            if started.elapsed() > READY_TIMEOUT {
                self.kill9();
                return Err(std::io::Error::other(format!(
                    "rivet-operator's /healthz did not answer 200 within {READY_TIMEOUT:?}; log:\n{}",
                    last_lines(&self.log(), 40)
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// This start's `--leader-election-identity`.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Its `/metrics` and `/healthz` address.
    pub fn metrics_address(&self) -> SocketAddr {
        self.metrics
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("rivet-operator.log")
    }

    /// Its log so far (every start's).
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// The temp dir holding its log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Waits until the Lease names this start's identity as its holder
    /// (a watch on the Lease); an error after `timeout` quotes the log.
    pub async fn wait_leading(&self, timeout: Duration) -> std::io::Result<Lease> {
        let identity = self.identity.clone();
        let holds = move |lease: Option<&Lease>| {
            lease
                .and_then(|l| l.spec.as_ref())
                .and_then(|s| s.holder_identity.as_deref())
                == Some(identity.as_str())
        };
        match tokio::time::timeout(timeout, await_condition(self.leases.clone(), LEASE_NAME, holds)).await {
            Ok(Ok(Some(lease))) => Ok(lease),
            Ok(Ok(None)) => Err(std::io::Error::other("the Lease disappeared while waiting")),
            Ok(Err(e)) => Err(std::io::Error::other(format!("watching the Lease: {e}"))),
            Err(_) => Err(std::io::Error::other(format!(
                "{} did not lead within {timeout:?}; log:\n{}",
                self.identity,
                last_lines(&self.log(), 40)
            ))),
        }
    }

    /// Its `rivet_operator_leader` gauge (1 while it leads), from `/metrics`.
    pub async fn leader_gauge(&self) -> std::io::Result<f64> {
        let text = http_get(self.metrics, "/metrics").await?;
        metric_sample(&text, "rivet_operator_leader")
            .ok_or_else(|| std::io::Error::other(format!("no rivet_operator_leader in /metrics:\n{text}")))
    }

    /// SIGKILL and reap: a crash at an arbitrary moment.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for the exit (a clean stop releases the Lease).
    pub async fn stop(&mut self) -> std::io::Result<ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| std::io::Error::other("rivet-operator is not running"))?;
        let pid = libc::pid_t::try_from(child.id()).map_err(std::io::Error::other)?;
        // SAFETY: kill(2) on the pid of a child this fixture has not reaped.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if started.elapsed() > STOP_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::other(format!(
                    "rivet-operator ignored SIGTERM for {STOP_TIMEOUT:?}; killed. log:\n{}",
                    last_lines(&self.log(), 40)
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Kills it (if running) and starts it again with a new identity.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.spawn().await
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill9();
    }
}
