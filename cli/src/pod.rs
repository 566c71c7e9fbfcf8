//! `rivet pod add|del|list|exec`: test pods — network namespaces with labels —
//! created and deleted through the node's installed CNI configuration,
//! exactly as a container runtime calls it, and [`CniRunner`], the small
//! libcni behind them.
//!
//! A pod is a network namespace `rivet-pod-<node>-<namespace>-<name>`
//! (`ip netns add`). `pod add` reads the network configuration list the node
//! installed (`<cni-conf-dir>/10-rivet.conflist`, or `--conflist`) and runs
//! each plugin of the chain with `CNI_COMMAND=ADD`, the container id, the
//! namespace path, `CNI_IFNAME`, `CNI_ARGS`
//! (`IgnoreUnknown=1;K8S_POD_NAMESPACE=..;K8S_POD_NAME=..;K8S_POD_INFRA_CONTAINER_ID=..`)
//! and `CNI_PATH`, the plugin's configuration with `name`, `cniVersion` and
//! the previous plugin's result (`prevResult`) on stdin, inside the node's
//! network namespace when the node has one. Labels go to the plugin in
//! `args.cni.labels` (`[{"key": .., "value": ..}]`, the CNI conventions) and,
//! for a plugin that declares the capability `labels`, in
//! `runtimeConfig.labels` (the same list); named ports (`--port
//! http=TCP/8080`) likewise in `args.cni.containerPorts` and
//! `runtimeConfig.containerPorts`, as Kubernetes ContainerPort objects.
//!
//! The pod's record — container id, namespace, the configuration used and
//! the cached result — is `<state-dir>/pods/<namespace>_<name>.json`, written
//! before the first plugin runs so that a half-made pod can always be
//! deleted. `pod del` stops what runs in the pod's namespace (as a runtime
//! stops the containers), runs DEL through the chain in reverse order with
//! the cached result as `prevResult`, then removes the namespace and the
//! record; deleting a pod that does not exist succeeds.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Args, Subcommand};
use rivet_common::state_file::StateFile;
use rivet_proto::endpoint::v1 as endpoint_pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::node::NodeRecord;
use crate::table::Table;
use crate::{Context, age, netns, now_unix_nanos};

/// Interface name inside a pod.
pub const DEFAULT_IFNAME: &str = "eth0";

/// Namespace of pods added without `--namespace`.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Prefix of pod network namespace names.
pub const POD_NETNS_PREFIX: &str = "rivet-pod-";

/// Directory of pod records under the state dir.
pub const PODS_DIR: &str = "pods";

/// Schema version of a pod record.
const POD_SCHEMA: u32 = 1;

/// How long processes in a pod's namespace get between SIGTERM and SIGKILL.
const POD_STOP_GRACE: Duration = Duration::from_secs(2);

/// `rivet pod ...`
#[derive(Debug, Subcommand)]
pub enum PodCommand {
    /// Create a pod: a network namespace wired by the node's CNI configuration.
    Add(AddArgs),
    /// Delete a pod: CNI DEL, then its namespace (succeeds when it does not exist).
    Del {
        /// Pod name.
        name: String,
        /// Pod namespace.
        #[arg(long, short = 'n', default_value = DEFAULT_NAMESPACE)]
        namespace: String,
        /// Remove the namespace and the record even when a plugin's DEL fails.
        #[arg(long)]
        force: bool,
        /// Deadline of each plugin call, seconds.
        #[arg(long, default_value_t = 60)]
        cni_timeout: u64,
    },
    /// Every pod of the node with its addresses and endpoint: those of `rivet
    /// pod add` and those a runtime (containerd, kubelet) created through the
    /// CNI plugin, from svc-endpoint's endpoints (CREATED BY says which).
    List,
    /// Run a command inside a pod's network namespace.
    Exec {
        /// Pod name.
        name: String,
        /// Pod namespace.
        #[arg(long, short = 'n', default_value = DEFAULT_NAMESPACE)]
        namespace: String,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
}

/// `rivet pod add`.
#[derive(Debug, Args)]
pub struct AddArgs {
    /// Pod name (a DNS label: lowercase letters, digits, `-`).
    pub name: String,
    /// Pod namespace.
    #[arg(long, short = 'n', default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// A pod label `key=value`; repeat for several.
    #[arg(long = "label", short = 'l', value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// A named container port `NAME=PROTOCOL/PORT` (or `NAME=PORT`, TCP),
    /// for NetworkPolicy rules that name it; repeat for several.
    #[arg(long = "port", short = 'p', value_name = "NAME=PROTO/PORT", value_parser = parse_port)]
    pub ports: Vec<ContainerPort>,
    /// Interface name inside the pod.
    #[arg(long, default_value = DEFAULT_IFNAME)]
    pub ifname: String,
    /// Use this network configuration list instead of the node's installed one.
    #[arg(long, value_name = "FILE")]
    pub conflist: Option<PathBuf>,
    /// Where the plugins are (CNI_PATH); default: the node's CNI bin dir.
    #[arg(long, value_name = "DIR")]
    pub cni_bin_dir: Option<PathBuf>,
    /// Deadline of each plugin call, seconds.
    #[arg(long, default_value_t = 60)]
    pub cni_timeout: u64,
}

/// `key=value` of `--label`.
fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !k.contains(char::is_whitespace) => Ok((k.into(), v.into())),
        _ => Err(format!("`{s}` is not a label: give key=value")),
    }
}

/// A named container port of a pod (Kubernetes' ContainerPort with a name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerPort {
    /// The port's name.
    pub name: String,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// 1..65535.
    pub port: u16,
}

impl ContainerPort {
    /// As the CNI plugin takes it (`{"name", "containerPort", "protocol"}`).
    pub fn to_json(&self) -> Value {
        json!({"name": self.name, "containerPort": self.port, "protocol": self.protocol})
    }
}

/// `NAME=PROTOCOL/PORT` or `NAME=PORT` (TCP) of `--port`; the protocol in
/// any case.
///
/// ```
/// use rivet_cli::pod::parse_port;
/// assert_eq!(parse_port("dns=udp/53").unwrap().protocol, "UDP");
/// assert_eq!(parse_port("http=8080").unwrap().port, 8080);
/// assert!(parse_port("http=TCP/0").is_err());
/// ```
pub fn parse_port(s: &str) -> Result<ContainerPort, String> {
    let usage = || format!("`{s}` is not a named port: give NAME=PROTOCOL/PORT (e.g. http=TCP/8080) or NAME=PORT");
    let (name, rest) = s.split_once('=').ok_or_else(usage)?;
    rivet_common::named_port::check_port_name(name)?;
    let (protocol, port) = rest.split_once('/').unwrap_or(("TCP", rest));
    let protocol = protocol.to_ascii_uppercase();
    if !matches!(protocol.as_str(), "TCP" | "UDP" | "SCTP") {
        return Err(format!("`{s}`: the protocol must be TCP, UDP or SCTP"));
    }
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("`{s}`: the port must be 1 to 65535"))?;
    Ok(ContainerPort {
        name: name.to_string(),
        protocol,
        port,
    })
}

/// Checks a pod or namespace name: a DNS label (1 to 63 of `[a-z0-9-]`, not
/// starting or ending with `-`).
///
/// ```
/// assert!(rivet_cli::pod::check_dns_label("pod", "frontend-1").is_ok());
/// assert!(rivet_cli::pod::check_dns_label("pod", "Frontend").is_err());
/// ```
pub fn check_dns_label(what: &str, s: &str) -> Result<()> {
    rivet_common::k8s_name::check_dns_label(s).map_err(|e| anyhow!("`{s}` is not a valid {what} name: it {e}"))
}

// ---------------------------------------------------------------------------
// The mini libcni.

/// A network configuration list, as a runtime reads it from the conf dir.
#[derive(Debug, Clone, PartialEq)]
pub struct NetworkConfigList {
    /// `cniVersion` of the list, given to every plugin.
    pub cni_version: String,
    /// Network name, given to every plugin.
    pub name: String,
    /// Each plugin's configuration object (has a string `type`).
    pub plugins: Vec<Map<String, Value>>,
}

impl NetworkConfigList {
    /// Parses a `.conflist`, or a single-plugin `.conf` (an object with
    /// `type` and no `plugins`) as a list of one.
    ///
    /// ```
    /// let list = rivet_cli::pod::NetworkConfigList::parse(
    ///     r#"{"cniVersion": "1.1.0", "name": "rivet", "plugins": [{"type": "rivet-cni"}]}"#,
    /// ).unwrap();
    /// assert_eq!(list.plugin_types(), ["rivet-cni"]);
    /// ```
    pub fn parse(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).context("not JSON")?;
        let Value::Object(mut top) = value else {
            bail!("a network configuration must be a JSON object");
        };
        let string = |top: &Map<String, Value>, key: &str| -> Result<String> {
            match top.get(key) {
                Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
                Some(_) => bail!("`{key}` must be a non-empty string"),
                None => bail!("`{key}` is missing"),
            }
        };
        let cni_version = string(&top, "cniVersion")?;
        let name = string(&top, "name")?;
        let plugins = match top.remove("plugins") {
            Some(Value::Array(plugins)) => plugins,
            Some(_) => bail!("`plugins` must be an array"),
            // A single plugin's .conf.
            None if top.contains_key("type") => vec![Value::Object(top)],
            None => bail!("`plugins` is missing"),
        };
        if plugins.is_empty() {
            bail!("`plugins` is empty");
        }
        let plugins = plugins
            .into_iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::Object(p) => match p.get("type") {
                    Some(Value::String(t)) if !t.is_empty() && !t.contains('/') => Ok(p),
                    _ => bail!("plugins[{i}]: `type` must be a plugin name"),
                },
                _ => bail!("plugins[{i}] must be an object"),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cni_version,
            name,
            plugins,
        })
    }

    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("{} is not a usable network configuration", path.display()))
    }

    /// The list as JSON (kept in the pod record for DEL).
    pub fn to_value(&self) -> Value {
        json!({
            "cniVersion": self.cni_version,
            "name": self.name,
            "plugins": self.plugins,
        })
    }

    /// Each plugin's `type`, in chain order.
    pub fn plugin_types(&self) -> Vec<&str> {
        self.plugins
            .iter()
            .map(|p| p.get("type").and_then(Value::as_str).unwrap_or_default())
            .collect()
    }
}

/// A CNI operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CniCommand {
    /// Attach.
    Add,
    /// Detach (idempotent).
    Del,
    /// Verify an attachment.
    Check,
}

impl CniCommand {
    /// The `CNI_COMMAND` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
        }
    }
}

/// What identifies one attachment, the same for every call about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`.
    pub netns: PathBuf,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `K8S_POD_NAMESPACE`.
    pub pod_namespace: String,
    /// `K8S_POD_NAME`.
    pub pod_name: String,
    /// Pod labels.
    pub labels: BTreeMap<String, String>,
    /// Named container ports.
    pub ports: Vec<ContainerPort>,
}

/// The environment of one plugin call (CNI spec §"Parameters"): a runtime
/// sets exactly these.
///
/// ```
/// use rivet_cli::pod::{Attachment, CniCommand, plugin_env};
/// let a = Attachment {
///     container_id: "c1".into(),
///     netns: "/run/netns/p".into(),
///     ifname: "eth0".into(),
///     pod_namespace: "default".into(),
///     pod_name: "web".into(),
///     labels: Default::default(),
///     ports: Vec::new(),
/// };
/// let env = plugin_env(CniCommand::Add, &a, &["/opt/cni/bin".into()]);
/// assert!(env.contains(&("CNI_COMMAND".into(), "ADD".into())));
/// ```
pub fn plugin_env(command: CniCommand, a: &Attachment, cni_path: &[PathBuf]) -> Vec<(String, String)> {
    let path = cni_path
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":");
    vec![
        ("CNI_COMMAND".into(), command.as_str().into()),
        ("CNI_CONTAINERID".into(), a.container_id.clone()),
        ("CNI_NETNS".into(), a.netns.display().to_string()),
        ("CNI_IFNAME".into(), a.ifname.clone()),
        (
            "CNI_ARGS".into(),
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={}",
                a.pod_namespace, a.pod_name, a.container_id
            ),
        ),
        ("CNI_PATH".into(), path),
    ]
}

/// The configuration a plugin gets on stdin: its own object from the list
/// plus `name`, `cniVersion`, `prevResult` when given, `runtimeConfig` for
/// the capabilities it declares (`labels`, `containerPorts`), and the labels
/// and ports in `args.cni.labels` and `args.cni.containerPorts` (merged into
/// any `args` of its own).
pub fn plugin_config(
    list: &NetworkConfigList,
    index: usize,
    a: &Attachment,
    prev_result: Option<&Value>,
) -> Result<Value> {
    let mut conf = list
        .plugins
        .get(index)
        .cloned()
        .ok_or_else(|| anyhow!("the list has no plugin {index}"))?;
    conf.insert("name".into(), Value::String(list.name.clone()));
    conf.insert("cniVersion".into(), Value::String(list.cni_version.clone()));
    match prev_result {
        Some(prev) => {
            conf.insert("prevResult".into(), prev.clone());
        }
        None => {
            conf.remove("prevResult");
        }
    }
    let declares = |capability: &str| {
        conf.get("capabilities")
            .and_then(|c| c.get(capability))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    let labels: Vec<Value> = a.labels.iter().map(|(k, v)| json!({"key": k, "value": v})).collect();
    let ports: Vec<Value> = a.ports.iter().map(ContainerPort::to_json).collect();
    let mut runtime = Map::new();
    if declares("labels") {
        runtime.insert("labels".into(), Value::Array(labels.clone()));
    }
    if declares("containerPorts") {
        runtime.insert("containerPorts".into(), Value::Array(ports.clone()));
    }
    if !runtime.is_empty() {
        conf.insert("runtimeConfig".into(), Value::Object(runtime));
    }
    for (key, values) in [("labels", labels), ("containerPorts", ports)] {
        if values.is_empty() {
            continue;
        }
        let args = conf.entry("args").or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(args) = args else {
            bail!("plugin {index}: `args` must be an object");
        };
        let cni = args.entry("cni").or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(cni) = cni else {
            bail!("plugin {index}: `args.cni` must be an object");
        };
        cni.insert(key.into(), Value::Array(values));
    }
    Ok(Value::Object(conf))
}

/// A plugin call that failed.
#[derive(Debug, thiserror::Error)]
#[error("{plugin} {command}: {message}")]
pub struct CniError {
    /// Plugin type.
    pub plugin: String,
    /// `ADD`, `DEL` or `CHECK`.
    pub command: &'static str,
    /// The spec's error code when the plugin printed one.
    pub code: Option<u64>,
    /// What went wrong: the plugin's `msg` and `details`, or why it could
    /// not be run, or its exit status and stderr.
    pub message: String,
}

/// The small libcni: finds plugins on CNI_PATH and runs a chain the way a
/// runtime does, inside a network namespace when one is given.
#[derive(Debug, Clone)]
pub struct CniRunner {
    /// Directories searched for plugins (also `CNI_PATH`).
    pub cni_path: Vec<PathBuf>,
    /// The node's network namespace (`/run/netns/<name>`); plugins run inside it.
    pub node_netns: Option<PathBuf>,
    /// Deadline of each plugin call.
    pub timeout: Duration,
    /// Where the plugins' stderr goes (a file); `None`: this process's stderr.
    pub stderr_log: Option<PathBuf>,
}

impl CniRunner {
    /// The plugin binary for `type`, from the first CNI_PATH dir that has it.
    pub fn find_plugin(&self, plugin_type: &str) -> Option<PathBuf> {
        self.cni_path
            .iter()
            .map(|dir| dir.join(plugin_type))
            .find(|p| p.is_file())
    }

    /// Runs one plugin of `list`; its parsed stdout (the result of ADD;
    /// `None` when it printed nothing, as DEL does).
    pub fn exec(
        &self,
        command: CniCommand,
        list: &NetworkConfigList,
        index: usize,
        a: &Attachment,
        prev_result: Option<&Value>,
    ) -> Result<Option<Value>, CniError> {
        let plugin_type = list.plugin_types().get(index).copied().unwrap_or_default().to_string();
        let fail = |code: Option<u64>, message: String| CniError {
            plugin: plugin_type.clone(),
            command: command.as_str(),
            code,
            message,
        };
        let binary = self.find_plugin(&plugin_type).ok_or_else(|| {
            fail(
                None,
                format!(
                    "plugin `{plugin_type}` not found in {}",
                    self.cni_path
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(":")
                ),
            )
        })?;
        let config = plugin_config(list, index, a, prev_result).map_err(|e| fail(None, e.to_string()))?;
        let mut cmd = netns::command(self.node_netns.as_deref(), &binary);
        cmd.env_clear()
            .env(
                "PATH",
                std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into()),
            )
            .envs(plugin_env(command, a, &self.cni_path))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for key in ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "RUST_LOG"] {
            if let Some(v) = std::env::var_os(key) {
                cmd.env(key, v);
            }
        }
        let stderr_file = match &self.stderr_log {
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| fail(None, format!("opening {}: {e}", path.display())))?,
            ),
            None => None,
        };
        match stderr_file {
            Some(f) => cmd.stderr(f),
            None => cmd.stderr(Stdio::piped()),
        };
        let stdin = serde_json::to_vec(&config).expect("JSON values serialise");
        let out = run_with_deadline(&mut cmd, &stdin, self.timeout)
            .map_err(|e| fail(None, format!("running {}: {e}", binary.display())))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            // The spec's error object on stdout; else whatever it said.
            if let Ok(err) = serde_json::from_str::<Value>(&stdout)
                && let Some(code) = err.get("code").and_then(Value::as_u64)
            {
                let msg = err.get("msg").and_then(Value::as_str).unwrap_or_default();
                let details = err.get("details").and_then(Value::as_str).unwrap_or_default();
                let message = if details.is_empty() {
                    format!("error {code}: {msg}")
                } else {
                    format!("error {code}: {msg}: {details}")
                };
                return Err(fail(Some(code), message));
            }
            let said = format!("{} {}", stdout.trim(), String::from_utf8_lossy(&out.stderr).trim());
            return Err(fail(None, format!("{} {}", out.status, said.trim())));
        }
        if stdout.trim().is_empty() {
            return Ok(None);
        }
        serde_json::from_str(&stdout)
            .map(Some)
            .map_err(|e| fail(None, format!("its output is not JSON ({e}): {}", stdout.trim())))
    }

    /// ADD through the chain, each plugin getting the previous one's result;
    /// the last result. On a failure the attachment is undone (DEL through
    /// the chain, best effort) and the ADD error returned.
    pub fn add(&self, list: &NetworkConfigList, a: &Attachment) -> Result<Value, CniError> {
        let mut result: Option<Value> = None;
        for index in 0..list.plugins.len() {
            match self.exec(CniCommand::Add, list, index, a, result.as_ref()) {
                Ok(Some(r)) => result = Some(r),
                Ok(None) => {
                    return Err(self.undo_add(
                        list,
                        a,
                        result.as_ref(),
                        CniError {
                            plugin: list.plugin_types()[index].to_string(),
                            command: "ADD",
                            code: None,
                            message: "printed no result".into(),
                        },
                    ));
                }
                Err(e) => return Err(self.undo_add(list, a, result.as_ref(), e)),
            }
        }
        result.ok_or_else(|| CniError {
            plugin: list.name.clone(),
            command: "ADD",
            code: None,
            message: "the list has no plugins".into(),
        })
    }

    fn undo_add(&self, list: &NetworkConfigList, a: &Attachment, result: Option<&Value>, e: CniError) -> CniError {
        if let Err(del) = self.del(list, a, result) {
            eprintln!("warning: undoing the failed ADD: {del}");
        }
        e
    }

    /// DEL through the chain in reverse order with the cached ADD result as
    /// `prevResult`. Every plugin is called even after a failure; the first
    /// failure is returned.
    pub fn del(&self, list: &NetworkConfigList, a: &Attachment, cached: Option<&Value>) -> Result<(), CniError> {
        let mut first_error = None;
        for index in (0..list.plugins.len()).rev() {
            if let Err(e) = self.exec(CniCommand::Del, list, index, a, cached) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// CHECK through the chain with the cached result.
    pub fn check(&self, list: &NetworkConfigList, a: &Attachment, cached: &Value) -> Result<(), CniError> {
        for index in 0..list.plugins.len() {
            self.exec(CniCommand::Check, list, index, a, Some(cached))?;
        }
        Ok(())
    }
}

/// Output of a child run with a deadline.
struct ChildOutput {
    status: std::process::ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// Spawns `cmd`, writes `stdin`, collects stdout (and stderr if piped);
/// kills it after `timeout`.
fn run_with_deadline(cmd: &mut Command, stdin: &[u8], timeout: Duration) -> std::io::Result<ChildOutput> {
    let mut child = cmd.spawn()?;
    if let Some(mut pipe) = child.stdin.take() {
        // A plugin that exits without reading gives EPIPE: its exit status says more.
        let _ = pipe.write_all(stdin);
    }
    let reader = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = reader(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = reader(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {timeout:?}; killed"),
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Ok(ChildOutput {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

// ---------------------------------------------------------------------------
// Pod records.

/// Where a pod is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PodPhase {
    /// Namespace created, ADD running (or interrupted).
    Creating,
    /// ADD succeeded.
    Ready,
    /// DEL running (or failed).
    Deleting,
}

/// One test pod, as recorded under `<state-dir>/pods/`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PodRecord {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod labels.
    pub labels: BTreeMap<String, String>,
    /// Named container ports.
    #[serde(default)]
    pub ports: Vec<ContainerPort>,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// Network namespace name.
    pub netns: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// The network configuration list ADD used (DEL uses the same).
    pub network: Value,
    /// `CNI_PATH`.
    pub cni_path: Vec<PathBuf>,
    /// The node namespace the plugins run in.
    pub node_netns: Option<PathBuf>,
    /// Lifecycle phase.
    pub phase: PodPhase,
    /// The result of the chain's ADD.
    pub result: Option<Value>,
    /// Creation time, Unix nanoseconds.
    pub created_unix_nanos: i64,
}

impl PodRecord {
    /// `/run/netns/<netns>`.
    pub fn netns_path(&self) -> PathBuf {
        netns::path(&self.netns)
    }

    /// The attachment the CNI calls are about.
    pub fn attachment(&self) -> Attachment {
        Attachment {
            container_id: self.container_id.clone(),
            netns: self.netns_path(),
            ifname: self.ifname.clone(),
            pod_namespace: self.namespace.clone(),
            pod_name: self.name.clone(),
            labels: self.labels.clone(),
            ports: self.ports.clone(),
        }
    }

    /// The addresses of the ADD result (`ips[].address`, without prefix length).
    pub fn addresses(&self) -> Vec<String> {
        result_addresses(self.result.as_ref())
    }
}

/// `ips[].address` of a CNI result, without prefix length.
///
/// ```
/// let r = serde_json::json!({"ips": [{"address": "198.18.0.2/22"}, {"address": "2001:2::2/64"}]});
/// assert_eq!(rivet_cli::pod::result_addresses(Some(&r)), ["198.18.0.2", "2001:2::2"]);
/// ```
pub fn result_addresses(result: Option<&Value>) -> Vec<String> {
    result
        .and_then(|r| r.get("ips"))
        .and_then(Value::as_array)
        .map(|ips| {
            ips.iter()
                .filter_map(|ip| ip.get("address").and_then(Value::as_str))
                .map(|a| a.split('/').next().unwrap_or(a).to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn pods_dir(state_dir: &Path) -> PathBuf {
    state_dir.join(PODS_DIR)
}

fn pod_file(state_dir: &Path, namespace: &str, name: &str) -> StateFile<PodRecord> {
    StateFile::new(
        pods_dir(state_dir).join(format!("{namespace}_{name}.json")),
        "pod",
        POD_SCHEMA,
    )
}

/// Every pod record of the node, by namespace and name.
pub fn load_pods(state_dir: &Path) -> Result<Vec<PodRecord>> {
    let dir = pods_dir(state_dir);
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut pods = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let file: StateFile<PodRecord> = StateFile::new(&path, "pod", POD_SCHEMA);
        if let Some(pod) = file.load()? {
            pods.push(pod);
        }
    }
    pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(pods)
}

/// A fresh container id: 64 hex digits, like a runtime's.
fn new_container_id() -> String {
    format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

/// The node the pod commands act on: `<state-dir>/node.json`.
fn require_node(state_dir: &Path) -> Result<NodeRecord> {
    NodeRecord::load(state_dir)?.ok_or_else(|| {
        anyhow!(
            "no node in {}: start one with `rivet --state-dir {} node up`",
            state_dir.display(),
            state_dir.display()
        )
    })
}

/// Creates a pod; its record.
pub fn add(state_dir: &Path, args: &AddArgs) -> Result<PodRecord> {
    check_dns_label("pod", &args.name)?;
    check_dns_label("namespace", &args.namespace)?;
    let node = require_node(state_dir)?;
    if node.phase != crate::node::NodePhase::Running || !crate::node::supervisor_alive(node.supervisor_pid) {
        bail!(
            "node {} is not running ({:?}, supervisor pid {}); see `rivet node status`",
            node.node_name,
            node.phase,
            node.supervisor_pid
        );
    }
    let file = pod_file(state_dir, &args.namespace, &args.name);
    if let Some(existing) = file.load()? {
        bail!(
            "pod {}/{} exists already ({:?}); delete it first with `rivet pod del {} -n {}`",
            args.namespace,
            args.name,
            existing.phase,
            args.name,
            args.namespace
        );
    }
    let conflist_path = args.conflist.clone().unwrap_or_else(|| node.conflist.clone());
    let list = NetworkConfigList::load(&conflist_path)?;
    let cni_path = vec![args.cni_bin_dir.clone().unwrap_or_else(|| node.cni_bin_dir.clone())];
    let pod_netns = format!("{POD_NETNS_PREFIX}{}-{}-{}", node.node_name, args.namespace, args.name);
    netns::check_name(&pod_netns)?;
    let mut record = PodRecord {
        namespace: args.namespace.clone(),
        name: args.name.clone(),
        labels: args.labels.iter().cloned().collect(),
        ports: args.ports.clone(),
        container_id: new_container_id(),
        netns: pod_netns.clone(),
        ifname: args.ifname.clone(),
        network: list.to_value(),
        cni_path: cni_path.clone(),
        node_netns: node.netns_path.clone(),
        phase: PodPhase::Creating,
        result: None,
        created_unix_nanos: now_unix_nanos(),
    };
    netns::create(&pod_netns)?;
    // Recorded before any plugin runs: a half-made pod can always be deleted.
    if let Err(e) = file.store(&record) {
        let _ = netns::delete(&pod_netns);
        return Err(e.into());
    }
    let runner = CniRunner {
        cni_path,
        node_netns: node.netns_path.clone(),
        timeout: Duration::from_secs(args.cni_timeout),
        stderr_log: None,
    };
    match runner.add(&list, &record.attachment()) {
        Ok(result) => {
            record.result = Some(result);
            record.phase = PodPhase::Ready;
            file.store(&record)?;
            Ok(record)
        }
        Err(e) => {
            // ADD undid itself; the namespace and the record go too.
            let _ = netns::delete(&pod_netns);
            let _ = std::fs::remove_file(file.path());
            Err(anyhow!(e).context(format!("creating pod {}/{}", args.namespace, args.name)))
        }
    }
}

/// What `del` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// The pod existed and is gone.
    Deleted,
    /// There was no such pod.
    NotFound,
}

/// Deletes a pod: stops what runs in its namespace, DEL through the chain,
/// then the namespace and the record. A DEL failure keeps both (for a
/// retry) unless `force`.
pub fn del(state_dir: &Path, namespace: &str, name: &str, force: bool, timeout: Duration) -> Result<Deleted> {
    let file = pod_file(state_dir, namespace, name);
    let Some(mut record) = file.load()? else {
        return Ok(Deleted::NotFound);
    };
    record.phase = PodPhase::Deleting;
    file.store(&record)?;
    stop_processes(&record.netns);
    let list = NetworkConfigList::parse(&record.network.to_string())
        .with_context(|| format!("the network configuration recorded for pod {namespace}/{name}"))?;
    let runner = CniRunner {
        cni_path: record.cni_path.clone(),
        node_netns: record.node_netns.clone(),
        timeout,
        stderr_log: None,
    };
    // DEL needs the namespace path to exist or be absent; plugins handle both.
    if let Err(e) = runner.del(&list, &record.attachment(), record.result.as_ref()) {
        if !force {
            return Err(anyhow!(e).context(format!(
                "deleting pod {namespace}/{name} (kept for a retry; `--force` removes it anyway)"
            )));
        }
        eprintln!("warning: pod {namespace}/{name}: {e}; removing it anyway (--force)");
    }
    netns::delete(&record.netns)?;
    match std::fs::remove_file(file.path()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", file.path().display())),
    }
    Ok(Deleted::Deleted)
}

/// Deletes every pod of the node (when it stops); failures are reported
/// and the pods removed anyway.
pub fn delete_all(state_dir: &Path, timeout: Duration) -> Vec<String> {
    let mut messages = Vec::new();
    match load_pods(state_dir) {
        Ok(pods) => {
            for pod in pods {
                match del(state_dir, &pod.namespace, &pod.name, true, timeout) {
                    Ok(_) => messages.push(format!("pod {}/{} deleted", pod.namespace, pod.name)),
                    Err(e) => messages.push(format!("pod {}/{}: {e:#}", pod.namespace, pod.name)),
                }
            }
        }
        Err(e) => messages.push(format!("reading pod records: {e:#}")),
    }
    let _ = std::fs::remove_dir(pods_dir(state_dir));
    messages
}

/// SIGTERM, then SIGKILL after a grace period, to the processes in the
/// named namespace (a runtime stops a pod's containers before DEL).
fn stop_processes(ns: &str) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let pids = || -> Vec<Pid> {
        let me = std::process::id();
        netns::run(Command::new("ip").args(["netns", "pids", ns]))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
            .filter(|p| u32::try_from(*p).is_ok_and(|p| p != me))
            .map(Pid::from_raw)
            .collect()
    };
    let running = pids();
    if running.is_empty() {
        return;
    }
    for pid in &running {
        let _ = kill(*pid, Signal::SIGTERM);
    }
    let deadline = Instant::now() + POD_STOP_GRACE;
    while Instant::now() < deadline && !pids().is_empty() {
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in pids() {
        let _ = kill(pid, Signal::SIGKILL);
    }
}

// ---------------------------------------------------------------------------
// The command.

/// Who created a pod of `rivet pod list`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CreatedBy {
    /// `rivet pod add` (it has a record under `<state-dir>/pods/`).
    RivetPod,
    /// A runtime calling the CNI plugin (known from its endpoint only).
    Runtime,
}

impl CreatedBy {
    /// As printed.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RivetPod => "rivet pod",
            Self::Runtime => "runtime",
        }
    }
}

/// One row of `rivet pod list`.
#[derive(Debug, Clone, Serialize)]
pub struct PodView {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Addresses from the CNI result.
    pub addresses: Vec<String>,
    /// svc-endpoint's endpoint id.
    pub endpoint_id: Option<u32>,
    /// Its security identity.
    pub identity: Option<u32>,
    /// The endpoint's state, or the pod's phase when it has no endpoint.
    pub state: String,
    /// Pod labels.
    pub labels: BTreeMap<String, String>,
    /// Network namespace name.
    pub netns: String,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// Creation time, Unix nanoseconds.
    pub created_unix_nanos: i64,
    /// `rivet pod add` or a runtime.
    pub created_by: CreatedBy,
}

/// Runs `rivet pod ...`.
pub async fn run(ctx: &Context, state_dir: &Path, command: PodCommand) -> Result<bool> {
    match command {
        PodCommand::Add(args) => {
            let state_dir = state_dir.to_path_buf();
            let record = tokio::task::spawn_blocking(move || add(&state_dir, &args)).await??;
            ctx.print(&record, || {
                format!(
                    "pod {}/{} added: {} {} (netns {}, container {})\n",
                    record.namespace,
                    record.name,
                    record.ifname,
                    display_list(&record.addresses()),
                    record.netns,
                    &record.container_id[..12.min(record.container_id.len())]
                )
            });
            Ok(true)
        }
        PodCommand::Del {
            name,
            namespace,
            force,
            cni_timeout,
        } => {
            let state_dir = state_dir.to_path_buf();
            let (ns, n) = (namespace.clone(), name.clone());
            let deleted =
                tokio::task::spawn_blocking(move || del(&state_dir, &ns, &n, force, Duration::from_secs(cni_timeout)))
                    .await??;
            let text = match deleted {
                Deleted::Deleted => "deleted",
                Deleted::NotFound => "not found (nothing to do)",
            };
            ctx.print(&json!({"namespace": namespace, "name": name, "result": text}), || {
                format!("pod {namespace}/{name} {text}\n")
            });
            Ok(true)
        }
        PodCommand::List => {
            let pods = load_pods(state_dir)?;
            let views = list_views(ctx, pods).await;
            ctx.print(&views, || {
                let now = now_unix_nanos();
                let mut t = Table::new([
                    "NAMESPACE",
                    "NAME",
                    "ADDRESSES",
                    "ENDPOINT",
                    "IDENTITY",
                    "STATE",
                    "CREATED BY",
                    "AGE",
                ]);
                for v in &views {
                    t.row([
                        v.namespace.clone(),
                        v.name.clone(),
                        display_list(&v.addresses),
                        v.endpoint_id.map_or("-".into(), |i| i.to_string()),
                        v.identity.map_or("-".into(), |i| i.to_string()),
                        v.state.clone(),
                        v.created_by.as_str().into(),
                        age(now, v.created_unix_nanos),
                    ]);
                }
                t.render()
            });
            Ok(true)
        }
        PodCommand::Exec {
            name,
            namespace,
            command,
        } => exec(state_dir, &namespace, &name, &command),
    }
}

/// `a, b`, or `-` for none.
fn display_list(items: &[String]) -> String {
    if items.is_empty() { "-".into() } else { items.join(",") }
}

/// Pods of `rivet pod add` joined with svc-endpoint's endpoints (by
/// container id and interface), then the endpoints no record claims: pods a
/// runtime created. Sorted by namespace and name.
async fn list_views(ctx: &Context, pods: Vec<PodRecord>) -> Vec<PodView> {
    let endpoints = async {
        let channel = ctx.connect("svc-endpoint").await.map_err(|e| e.to_string())?;
        EndpointServiceClient::new(channel)
            .list_endpoints(endpoint_pb::ListEndpointsRequest::default())
            .await
            .map(|r| r.into_inner().endpoints)
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    }
    .await;
    let mut views = join_pods_and_endpoints(pods, &endpoints);
    views.sort_by(|a, b| (&a.namespace, &a.name, &a.container_id).cmp(&(&b.namespace, &b.name, &b.container_id)));
    views
}

/// Every pod record as a row, its endpoint's state when it has one; then a
/// row per endpoint that belongs to no record (the node's health endpoint
/// is no pod: `rivet endpoint list` shows it).
fn join_pods_and_endpoints(
    pods: Vec<PodRecord>,
    endpoints: &Result<Vec<endpoint_pb::Endpoint>, String>,
) -> Vec<PodView> {
    let of_record =
        |e: &endpoint_pb::Endpoint, pod: &PodRecord| e.container_id == pod.container_id && e.interface == pod.ifname;
    let runtime_pods: Vec<PodView> = endpoints
        .iter()
        .flatten()
        .filter(|e| !pods.iter().any(|pod| of_record(e, pod)))
        .filter(|e| e.kind != endpoint_pb::EndpointKind::Health as i32)
        .map(runtime_pod_view)
        .collect();
    let mut views: Vec<PodView> = pods
        .into_iter()
        .map(|pod| {
            let endpoint = endpoints
                .as_ref()
                .ok()
                .and_then(|eps| eps.iter().find(|e| of_record(e, &pod)));
            let state = match (pod.phase, endpoint, &endpoints) {
                (PodPhase::Ready, Some(e), _) => crate::endpoint::state_name(e.state).to_string(),
                (PodPhase::Ready, None, Ok(_)) => "no endpoint".into(),
                (PodPhase::Ready, None, Err(_)) => "unknown (svc-endpoint unreachable)".into(),
                (PodPhase::Creating, ..) => "creating".into(),
                (PodPhase::Deleting, ..) => "deleting".into(),
            };
            PodView {
                addresses: pod.addresses(),
                endpoint_id: endpoint.map(|e| e.id),
                identity: endpoint.map(|e| e.identity).filter(|i| *i != 0),
                state,
                namespace: pod.namespace,
                name: pod.name,
                labels: pod.labels,
                netns: pod.netns,
                container_id: pod.container_id,
                created_unix_nanos: pod.created_unix_nanos,
                created_by: CreatedBy::RivetPod,
            }
        })
        .collect();
    views.extend(runtime_pods);
    views
}

/// A pod a runtime created, from its endpoint: Kubernetes names when the
/// runtime passed them (`K8S_POD_*`), else `-` and `container:<short id>`;
/// `k8s:` labels shown as `key`.
fn runtime_pod_view(e: &endpoint_pb::Endpoint) -> PodView {
    let labels = e
        .labels
        .iter()
        .map(|label| {
            let bare = label.strip_prefix("k8s:").unwrap_or(label);
            let (key, value) = bare.split_once('=').unwrap_or((bare, ""));
            (key.to_string(), value.to_string())
        })
        .collect();
    PodView {
        namespace: if e.pod_namespace.is_empty() {
            "-".into()
        } else {
            e.pod_namespace.clone()
        },
        name: if e.pod_name.is_empty() {
            format!("container:{}", &e.container_id[..12.min(e.container_id.len())])
        } else {
            e.pod_name.clone()
        },
        addresses: e
            .addresses
            .iter()
            .map(|a| rivet_proto::net::format_address(&a.address))
            .collect(),
        endpoint_id: Some(e.id),
        identity: Some(e.identity).filter(|i| *i != 0),
        state: crate::endpoint::state_name(e.state).to_string(),
        labels,
        netns: e.netns_path.clone(),
        container_id: e.container_id.clone(),
        created_unix_nanos: e.created_unix_nanos,
        created_by: CreatedBy::Runtime,
    }
}

/// Replaces this process with `command` inside the pod's namespace.
fn exec(state_dir: &Path, namespace: &str, name: &str, command: &[String]) -> Result<bool> {
    use std::os::unix::process::CommandExt;
    let record = pod_file(state_dir, namespace, name)
        .load()?
        .ok_or_else(|| anyhow!("no pod {namespace}/{name} (see `rivet pod list`)"))?;
    let (program, args) = command.split_first().ok_or_else(|| anyhow!("no command given"))?;
    let err = netns::command(Some(&record.netns_path()), program).args(args).exec();
    Err(anyhow!("running nsenter for pod {namespace}/{name}: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attachment() -> Attachment {
        Attachment {
            container_id: "abc123".into(),
            netns: "/run/netns/rivet-pod-n-default-web".into(),
            ifname: "eth0".into(),
            pod_namespace: "default".into(),
            pod_name: "web".into(),
            labels: [("app".to_string(), "web".to_string()), ("tier".into(), "front".into())].into(),
            ports: vec![parse_port("http=TCP/8080").unwrap()],
        }
    }

    const LIST: &str = r#"{
        "cniVersion": "1.1.0",
        "name": "rivet",
        "plugins": [
            {"type": "rivet-cni", "socketDir": "/s", "capabilities": {"labels": true}},
            {"type": "portmap", "args": {"cni": {"other": 1}}}
        ]
    }"#;

    #[test]
    fn conflist_parses_and_single_conf_is_a_list_of_one() {
        let list = NetworkConfigList::parse(LIST).unwrap();
        assert_eq!(list.cni_version, "1.1.0");
        assert_eq!(list.name, "rivet");
        assert_eq!(list.plugin_types(), ["rivet-cni", "portmap"]);
        // Round trip through the pod record.
        assert_eq!(NetworkConfigList::parse(&list.to_value().to_string()).unwrap(), list);

        let conf = NetworkConfigList::parse(r#"{"cniVersion": "1.0.0", "name": "br", "type": "bridge"}"#).unwrap();
        assert_eq!(conf.plugin_types(), ["bridge"]);
        assert_eq!(conf.plugins[0].get("name"), Some(&json!("br")));
    }

    #[test]
    fn conflist_errors_say_what_is_wrong() {
        for (text, expected) in [
            ("[]", "JSON object"),
            ("{", "not JSON"),
            (r#"{"name": "x", "plugins": []}"#, "`cniVersion` is missing"),
            (
                r#"{"cniVersion": "1.1.0", "name": "", "plugins": []}"#,
                "`name` must be",
            ),
            (r#"{"cniVersion": "1.1.0", "name": "x"}"#, "`plugins` is missing"),
            (
                r#"{"cniVersion": "1.1.0", "name": "x", "plugins": []}"#,
                "`plugins` is empty",
            ),
            (
                r#"{"cniVersion": "1.1.0", "name": "x", "plugins": [1]}"#,
                "plugins[0] must be an object",
            ),
            (
                r#"{"cniVersion": "1.1.0", "name": "x", "plugins": [{"type": "../x"}]}"#,
                "plugins[0]: `type`",
            ),
        ] {
            let err = format!("{:#}", NetworkConfigList::parse(text).unwrap_err());
            assert!(err.contains(expected), "{text}: {err}");
        }
    }

    #[test]
    fn the_health_endpoint_is_no_pod() {
        let endpoint = |id: u32, kind: endpoint_pb::EndpointKind| endpoint_pb::Endpoint {
            id,
            container_id: format!("c{id}"),
            interface: "eth0".into(),
            kind: kind.into(),
            ..Default::default()
        };
        let views = join_pods_and_endpoints(
            Vec::new(),
            &Ok(vec![
                endpoint(1, endpoint_pb::EndpointKind::Health),
                endpoint(2, endpoint_pb::EndpointKind::Pod),
            ]),
        );
        let ids: Vec<Option<u32>> = views.iter().map(|v| v.endpoint_id).collect();
        assert_eq!(ids, [Some(2)]);
    }

    #[test]
    fn env_is_what_a_runtime_sets() {
        let env = plugin_env(
            CniCommand::Del,
            &attachment(),
            &["/opt/cni/bin".into(), "/usr/lib/cni".into()],
        );
        let env: BTreeMap<_, _> = env.into_iter().collect();
        assert_eq!(env.len(), 6);
        assert_eq!(env["CNI_COMMAND"], "DEL");
        assert_eq!(env["CNI_CONTAINERID"], "abc123");
        assert_eq!(env["CNI_NETNS"], "/run/netns/rivet-pod-n-default-web");
        assert_eq!(env["CNI_IFNAME"], "eth0");
        assert_eq!(
            env["CNI_ARGS"],
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=abc123"
        );
        assert_eq!(env["CNI_PATH"], "/opt/cni/bin:/usr/lib/cni");
    }

    #[test]
    fn stdin_has_name_version_prev_result_and_labels() {
        let list = NetworkConfigList::parse(LIST).unwrap();
        let a = attachment();
        let prev = json!({"cniVersion": "1.1.0", "ips": [{"address": "198.18.0.2/22"}]});

        let first = plugin_config(&list, 0, &a, None).unwrap();
        assert_eq!(first["name"], "rivet");
        assert_eq!(first["cniVersion"], "1.1.0");
        assert_eq!(first["socketDir"], "/s");
        assert!(first.get("prevResult").is_none());
        // Declared capability: runtimeConfig; always: args.cni.labels.
        assert_eq!(
            first["runtimeConfig"],
            json!({"labels": [{"key": "app", "value": "web"}, {"key": "tier", "value": "front"}]})
        );
        assert_eq!(
            first["args"]["cni"]["labels"],
            json!([{"key": "app", "value": "web"}, {"key": "tier", "value": "front"}])
        );
        // Named ports as Kubernetes ContainerPorts (no capability declared:
        // args only).
        assert_eq!(
            first["args"]["cni"]["containerPorts"],
            json!([{"name": "http", "containerPort": 8080, "protocol": "TCP"}])
        );
        let mut ports_list = list.clone();
        ports_list.plugins[0].insert("capabilities".into(), json!({"containerPorts": true}));
        assert_eq!(
            plugin_config(&ports_list, 0, &a, None).unwrap()["runtimeConfig"],
            json!({"containerPorts": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]})
        );

        let second = plugin_config(&list, 1, &a, Some(&prev)).unwrap();
        assert_eq!(second["prevResult"], prev);
        assert!(
            second.get("runtimeConfig").is_none(),
            "portmap does not declare `labels`"
        );
        // Its own args are kept.
        assert_eq!(second["args"]["cni"]["other"], 1);
        assert_eq!(second["args"]["cni"]["labels"][0]["key"], "app");

        // Without labels and ports nothing is added.
        let bare = Attachment {
            labels: BTreeMap::new(),
            ports: Vec::new(),
            ..a
        };
        let conf = plugin_config(&list, 1, &bare, None).unwrap();
        assert!(conf["args"]["cni"].get("labels").is_none());
        assert!(conf["args"]["cni"].get("containerPorts").is_none());
        assert!(plugin_config(&list, 2, &bare, None).is_err());
    }

    #[test]
    fn named_ports_on_the_command_line() {
        let p = parse_port("metrics=SCTP/9090").unwrap();
        assert_eq!(
            (p.name.as_str(), p.protocol.as_str(), p.port),
            ("metrics", "SCTP", 9090)
        );
        assert_eq!(parse_port("web=tcp/80").unwrap().protocol, "TCP");
        assert_eq!(parse_port("web=80").unwrap().protocol, "TCP");
        for (bad, says) in [
            ("web", "NAME=PROTOCOL/PORT"),
            ("Web=80", "not a valid port name"),
            ("web=ICMP/80", "TCP, UDP or SCTP"),
            ("web=TCP/0", "1 to 65535"),
            ("web=TCP/x", "1 to 65535"),
        ] {
            let err = parse_port(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn labels_and_names() {
        assert_eq!(parse_label("app=web"), Ok(("app".into(), "web".into())));
        assert_eq!(parse_label("k8s:app="), Ok(("k8s:app".into(), String::new())));
        assert!(parse_label("app").is_err());
        assert!(parse_label("=x").is_err());
        check_dns_label("pod", "a").unwrap();
        for bad in ["", "-a", "a-", "A", "a_b", &"a".repeat(64)] {
            assert!(check_dns_label("pod", bad).is_err(), "{bad:?}");
        }
    }

    fn write_script(path: &Path, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A fake plugin (a shell script) shows what the runner passes and how
    /// it reads results and errors.
    #[test]
    fn runner_chains_results_and_reports_plugin_errors() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("calls");
        let script = |name: &str, body: &str| {
            let path = dir.path().join(name);
            write_script(&path, body);
        };
        // Records command and stdin, answers ADD with a result naming itself.
        let record = format!(
            "stdin=$(cat); echo \"$CNI_COMMAND $0 $stdin\" >> {}; \
             if [ \"$CNI_COMMAND\" = ADD ]; then echo '{{\"cniVersion\":\"1.1.0\",\"ips\":[{{\"address\":\"198.18.0.9/22\"}}]}}'; fi",
            log.display()
        );
        script("one", &record);
        script("two", &record);
        script(
            "bad",
            r#"cat >/dev/null; echo '{"cniVersion":"1.1.0","code":11,"msg":"try again","details":"daemon down"}'; exit 1"#,
        );
        let runner = CniRunner {
            cni_path: vec![dir.path().to_path_buf()],
            node_netns: None,
            timeout: Duration::from_secs(10),
            stderr_log: None,
        };
        let list = |types: &[&str]| {
            NetworkConfigList::parse(
                &json!({"cniVersion": "1.1.0", "name": "t",
                        "plugins": types.iter().map(|t| json!({"type": t})).collect::<Vec<_>>()})
                .to_string(),
            )
            .unwrap()
        };
        let result = runner.add(&list(&["one", "two"]), &attachment()).unwrap();
        assert_eq!(result_addresses(Some(&result)), ["198.18.0.9"]);
        let calls = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = calls.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("ADD ") && lines[0].contains("/one "), "{calls}");
        assert!(!lines[0].contains("prevResult"), "{calls}");
        assert!(lines[1].contains("/two ") && lines[1].contains("prevResult"), "{calls}");

        // A failing second plugin: its error, and the chain undone in reverse.
        std::fs::remove_file(&log).unwrap();
        let err = runner.add(&list(&["one", "bad"]), &attachment()).unwrap_err();
        assert_eq!(err.code, Some(11));
        assert_eq!(err.to_string(), "bad ADD: error 11: try again: daemon down");
        let calls = std::fs::read_to_string(&log).unwrap();
        let commands: Vec<&str> = calls.lines().map(|l| l.split(' ').next().unwrap()).collect();
        assert_eq!(commands, ["ADD", "DEL"], "{calls}");

        // DEL of a chain runs in reverse with the cached result.
        std::fs::remove_file(&log).unwrap();
        runner
            .del(&list(&["one", "two"]), &attachment(), Some(&result))
            .unwrap();
        let calls = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = calls.lines().collect();
        assert!(lines[0].starts_with("DEL ") && lines[0].contains("/two "), "{calls}");
        assert!(lines[1].contains("/one ") && lines[1].contains("198.18.0.9"), "{calls}");

        // A missing plugin is named.
        let err = runner.add(&list(&["missing"]), &attachment()).unwrap_err();
        assert!(err.message.contains("plugin `missing` not found"), "{err}");
    }

    #[test]
    fn a_hanging_plugin_is_killed_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        write_script(&dir.path().join("hang"), "exec sleep 30");
        let runner = CniRunner {
            cni_path: vec![dir.path().to_path_buf()],
            node_netns: None,
            timeout: Duration::from_millis(300),
            stderr_log: None,
        };
        let list =
            NetworkConfigList::parse(r#"{"cniVersion":"1.1.0","name":"t","plugins":[{"type":"hang"}]}"#).unwrap();
        let started = Instant::now();
        let err = runner.exec(CniCommand::Del, &list, 0, &attachment(), None).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(err.message.contains("killed"), "{err}");
    }
}
