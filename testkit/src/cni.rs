//! Running a CNI plugin binary the way a container runtime does, against a
//! simulated node (DESIGN.md §8).
//!
//! The plugin (rivet-cni or a reference plugin from [`PLUGIN_DIR`]) runs
//! inside the node namespace (`nsenter --net=<node ns> <plugin>`) with a
//! clean environment holding only `PATH` and the `CNI_*` variables
//! ([`cni_env`]), the netconf on stdin ([`node_conf`] for rivet-cni on a
//! node), and is timed from spawn to exit ([`exec_in_netns`], [`CniRun`]).
//! Pods are network namespaces ([`Pod`]) removed on drop. The node itself
//! (usually an [`EndpointNode`](crate::node::EndpointNode)) is the caller's:
//! this module only needs its namespace and socket dir. Used by rivet-cni's
//! cross-process tests and by `rivet-bench cni`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rivet_common::testing::netns::{NetNs, NetnsError};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt as _;

/// Where the reference plugins are (Debian's containernetworking-plugins):
/// the `CNI_PATH` of every run.
pub const PLUGIN_DIR: &str = "/usr/lib/cni";

/// `PATH` of a plugin's clean environment.
const PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// Name prefix of pod namespaces.
const POD_NS_PREFIX: &str = "rvp";

/// Why a run did not give a result.
#[derive(Debug, thiserror::Error)]
pub enum CniRunError {
    /// The plugin exited unsuccessfully.
    #[error("{program} failed ({status}): {stdout}\nstderr: {stderr}")]
    Failed {
        /// The plugin's file name.
        program: String,
        /// Its exit status.
        status: ExitStatus,
        /// What it printed (the spec's error JSON).
        stdout: String,
        /// Its stderr.
        stderr: String,
    },
    /// The plugin's stdout is not JSON.
    #[error("{program}'s stdout is not JSON ({error}): {stdout:?}\nstderr: {stderr}")]
    NotJson {
        /// The plugin's file name.
        program: String,
        /// The parse error.
        error: serde_json::Error,
        /// What it printed.
        stdout: String,
        /// Its stderr.
        stderr: String,
    },
}

/// One run of a plugin binary.
#[derive(Debug)]
pub struct CniRun {
    /// The plugin's file name (`rivet-cni`, `bridge`, ...).
    pub program: String,
    /// Its exit status.
    pub status: ExitStatus,
    /// stdout (the result or the error JSON).
    pub stdout: String,
    /// stderr.
    pub stderr: String,
    /// Wall time from spawning `nsenter` until the plugin exited and its
    /// output was read.
    pub elapsed: Duration,
}

impl CniRun {
    /// stdout as JSON (Null when empty).
    pub fn try_json(&self) -> Result<Value, CniRunError> {
        if self.stdout.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&self.stdout).map_err(|error| CniRunError::NotJson {
            program: self.program.clone(),
            error,
            stdout: self.stdout.clone(),
            stderr: self.stderr.clone(),
        })
    }

    /// stdout as JSON if the plugin succeeded.
    pub fn success(&self) -> Result<Value, CniRunError> {
        if !self.status.success() {
            return Err(CniRunError::Failed {
                program: self.program.clone(),
                status: self.status,
                stdout: self.stdout.clone(),
                stderr: self.stderr.clone(),
            });
        }
        self.try_json()
    }

    /// stdout as JSON (Null when empty); panics if it is not JSON.
    #[track_caller]
    pub fn json(&self) -> Value {
        self.try_json().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Asserts success; stdout as JSON.
    #[track_caller]
    pub fn ok(&self) -> Value {
        self.success().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Asserts failure with the spec's error JSON; the error.
    #[track_caller]
    pub fn err(&self) -> Value {
        assert!(
            !self.status.success(),
            "{} succeeded but should have failed: {}",
            self.program,
            self.stdout
        );
        let error = self.json();
        assert!(error["code"].is_u64(), "error JSON has a code: {error}");
        assert!(error["msg"].is_string(), "error JSON has a msg: {error}");
        assert!(error["cniVersion"].is_string(), "error JSON has a cniVersion: {error}");
        error
    }

    /// Asserts failure with `code`; the message.
    #[track_caller]
    pub fn err_code(&self, code: u64) -> String {
        let error = self.err();
        assert_eq!(error["code"], code, "{error}");
        error["msg"].as_str().unwrap_or_default().to_string()
    }
}

/// A pod: a network namespace (`rvp*`, removed on drop) and the container
/// id used for it.
#[derive(Debug)]
pub struct Pod {
    /// The pod's namespace.
    pub ns: NetNs,
    /// `CNI_CONTAINERID`.
    pub id: String,
}

impl Pod {
    /// A new pod namespace for container `id`.
    pub fn try_new(id: &str) -> Result<Self, NetnsError> {
        Ok(Self {
            ns: NetNs::new(POD_NS_PREFIX)?,
            id: id.to_string(),
        })
    }

    /// [`try_new`](Self::try_new); panics if the namespace cannot be created.
    #[track_caller]
    pub fn new(id: &str) -> Self {
        Self::try_new(id).expect("creating a pod namespace")
    }

    /// The namespace's path (`CNI_NETNS`).
    pub fn path(&self) -> PathBuf {
        self.ns.path()
    }

    /// The runtime's environment for `command` on this pod's `ifname`.
    pub fn env(&self, command: &str, ifname: &str) -> Vec<(String, String)> {
        cni_env(command, &self.id, &self.path(), ifname)
    }
}

/// The runtime's environment for an attachment verb: `CNI_COMMAND`,
/// `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME`, `CNI_PATH` ([`PLUGIN_DIR`])
/// and the `CNI_ARGS` kubelet passes (pod namespace `default`, pod name and
/// infra container id `container_id`, uid `uid-<container_id>`).
pub fn cni_env(command: &str, container_id: &str, netns: &Path, ifname: &str) -> Vec<(String, String)> {
    vec![
        ("CNI_COMMAND".into(), command.into()),
        ("CNI_CONTAINERID".into(), container_id.into()),
        ("CNI_NETNS".into(), netns.display().to_string()),
        ("CNI_IFNAME".into(), ifname.into()),
        ("CNI_PATH".into(), PLUGIN_DIR.into()),
        (
            "CNI_ARGS".into(),
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={container_id};\
                 K8S_POD_INFRA_CONTAINER_ID={container_id};K8S_POD_UID=uid-{container_id}"
            ),
        ),
    ]
}

/// rivet-cni's netconf (network `rivet`) for a node whose daemons listen in
/// `sockets`, in `version`: host veths named `<host_prefix><hash>` (the
/// prefix the node's svc-loader acts on), logs appended to `log_file` at
/// `log_level` (`None`: the plugin's default, `info` with a log file),
/// a 30 s timeout.
pub fn node_conf(version: &str, sockets: &Path, host_prefix: &str, log_file: &Path, log_level: Option<&str>) -> Value {
    let mut conf = json!({
        "cniVersion": version,
        "name": "rivet",
        "type": "rivet-cni",
        "socketDir": sockets,
        "hostInterfacePrefix": host_prefix,
        "logFile": log_file,
        "timeoutSeconds": 30,
    });
    if let Some(level) = log_level {
        conf["logLevel"] = json!(level);
    }
    conf
}

/// Runs the plugin `bin` in the network namespace at `netns` (`nsenter
/// --net=<netns> <bin>`) with exactly `env` plus `PATH`, `stdin` as its
/// input, killed if it does not finish within `timeout`; timed from spawn
/// until its output was read.
pub async fn exec_in_netns(
    netns: &Path,
    bin: &Path,
    env: &[(String, String)],
    stdin: &[u8],
    timeout: Duration,
) -> std::io::Result<CniRun> {
    let program = bin
        .file_name()
        .map_or_else(|| bin.display().to_string(), |n| n.to_string_lossy().into_owned());
    let started = Instant::now();
    let mut child = tokio::process::Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(bin)
        .env_clear()
        .env("PATH", PATH)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| std::io::Error::new(e.kind(), format!("running {program} under nsenter: {e}")))?;
    if let Some(mut input) = child.stdin.take() {
        // A plugin may stop reading (an oversized netconf) and exit: like
        // Go's os/exec under libcni, that is not the runtime's error.
        match input.write_all(stdin).await {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e),
            _ => {}
        }
    }
    let output = tokio::time::timeout(timeout, child.wait_with_output())
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{program} did not finish within {timeout:?}"),
            )
        })??;
    Ok(CniRun {
        program,
        status: output.status,
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        elapsed: started.elapsed(),
    })
}

/// The addresses of a result's `ips`, without prefix length; `None` if the
/// result has no `ips` list or an entry is not an address.
pub fn result_ips(result: &Value) -> Option<Vec<IpAddr>> {
    result["ips"]
        .as_array()?
        .iter()
        .map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_has_the_runtime_shape() {
        let env = cni_env("ADD", "c1", Path::new("/run/netns/p"), "eth0");
        let get = |k: &str| env.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        assert_eq!(get("CNI_COMMAND"), Some("ADD"));
        assert_eq!(get("CNI_NETNS"), Some("/run/netns/p"));
        assert_eq!(get("CNI_PATH"), Some(PLUGIN_DIR));
        assert_eq!(
            get("CNI_ARGS"),
            Some(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=c1;K8S_POD_INFRA_CONTAINER_ID=c1;\
                 K8S_POD_UID=uid-c1"
            )
        );
    }

    #[test]
    fn conf_sets_the_level_only_when_asked() {
        let conf = node_conf("1.1.0", Path::new("/s"), "rvh", Path::new("/l/cni.log"), None);
        assert_eq!(conf["socketDir"], "/s");
        assert_eq!(conf["logFile"], "/l/cni.log");
        assert!(conf.get("logLevel").is_none());
        let conf = node_conf("1.0.0", Path::new("/s"), "rvh", Path::new("/l"), Some("debug"));
        assert_eq!(conf["logLevel"], "debug");
        assert_eq!(conf["cniVersion"], "1.0.0");
    }

    #[test]
    fn ips_of_a_result() {
        let result = json!({"ips": [{"address": "198.18.0.2/22"}, {"address": "2001:2::2/64"}]});
        let ips = result_ips(&result).unwrap();
        assert_eq!(ips[0].to_string(), "198.18.0.2");
        assert_eq!(ips[1].to_string(), "2001:2::2");
        assert_eq!(result_ips(&json!({})), None);
        assert_eq!(result_ips(&json!({"ips": [{"address": "x"}]})), None);
    }
}
