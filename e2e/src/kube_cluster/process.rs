//! One daemon of the cluster (etcd, a control-plane component, a kubelet):
//! started inside the cluster's namespaces with `nsenter` (which execs the
//! program: the child's pid is the daemon's), its stdout and stderr in a log
//! file; stopped with SIGTERM, then SIGKILL, on drop.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::{KubeClusterError, io_err};

/// How long a daemon gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A running daemon; see the module docs.
#[derive(Debug)]
pub(super) struct Daemon {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    /// Runs `program args` through `nsenter <namespaces>` (e.g.
    /// `--net=/run/netns/x`), logging to `log`.
    pub fn spawn(
        name: &str,
        namespaces: &[String],
        program: &Path,
        args: &[String],
        log: PathBuf,
    ) -> Result<Self, KubeClusterError> {
        let out = File::create(&log).map_err(io_err(format!("creating {name}'s log {}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(io_err(format!("duplicating {name}'s log {}", log.display())))?;
        let mut command = Command::new("nsenter");
        command
            .args(namespaces)
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = command
            .spawn()
            .map_err(io_err(format!("starting {name} ({})", program.display())))?;
        Ok(Self {
            name: name.to_owned(),
            child: Some(child),
            log,
        })
    }

    /// The daemon's name in the cluster (`kube-apiserver`, `kubelet-n1`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Fails with its exit status and log tail when it exited.
    pub fn check_running(&mut self) -> Result<(), KubeClusterError> {
        let Some(child) = self.child.as_mut() else {
            return Err(self.exited("it was stopped".to_owned()));
        };
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                self.child = None;
                Err(self.exited(status.to_string()))
            }
            Err(e) => Err(self.exited(format!("waiting for it failed: {e}"))),
        }
    }

    fn exited(&self, status: String) -> KubeClusterError {
        KubeClusterError::Exited {
            name: self.name.clone(),
            status,
            log: self.log.clone(),
            tail: crate::tail(&std::fs::read_to_string(&self.log).unwrap_or_default(), 30),
        }
    }

    /// SIGTERM, up to [`STOP_GRACE`] to exit, then SIGKILL; reaped.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        let started = Instant::now();
        while matches!(child.try_wait(), Ok(None)) && started.elapsed() < STOP_GRACE {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}
