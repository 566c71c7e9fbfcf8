//! The network configuration on stdin: the spec's keys, Rivet's own keys
//! (validated strictly), labels, named container ports, requested addresses
//! and GC's valid attachments.
//!
//! Unknown top-level keys are accepted (a conflist may carry keys for other
//! tools), except spellings that differ from a known key only in case,
//! `_`, `-` or `.` (`socketdir`, `socket_dir`, `MTU`): those are almost
//! certainly typos of a key that would otherwise be silently ignored, and
//! fail with code 2 naming the key, its value and the right spelling.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use rivet_common::labels::{Label, LabelSource};
use serde_json::{Map, Value};

use crate::env::check_ifname;
use crate::error::{CniError, codes};
use crate::version::{self, CniVersion};

/// Default `socketDir`.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/rivet/sockets";
/// Default `ipamPool`.
pub const DEFAULT_IPAM_POOL: &str = "default";
/// Default `hostInterfacePrefix`.
pub const DEFAULT_HOST_PREFIX: &str = "lxc";
/// Longest `hostInterfacePrefix` (the rest of the 15 bytes is the hash).
pub const HOST_PREFIX_MAX: usize = 10;
/// Default `mtu`.
pub const DEFAULT_MTU: u32 = 1500;
/// Default `timeoutSeconds`.
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 30;
/// Largest `timeoutSeconds`.
pub const MAX_TIMEOUT_SECONDS: u64 = 3600;

/// Rivet's own keys.
pub const RIVET_KEYS: &[&str] = &[
    "socketDir",
    "ipamPool",
    "hostInterfacePrefix",
    "mtu",
    "logFile",
    "logLevel",
    "timeoutSeconds",
    "endpointKind",
    "tracing",
];

/// Keys of `tracing`.
const TRACING_KEYS: &[&str] = &["otlpEndpoint"];

/// Keys of the spec and its conventions that rivet-cni reads or tolerates.
const SPEC_KEYS: &[&str] = &[
    "cniVersion",
    "cniVersions",
    "name",
    "type",
    "ipam",
    "dns",
    "args",
    "prevResult",
    "runtimeConfig",
    "capabilities",
    "ipMasq",
    "disableCheck",
    "disableGC",
    "cni.dev/valid-attachments",
    "cni.dev/attachments",
];

/// `logLevel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// Errors only.
    Error,
    /// Warnings and errors.
    Warn,
    /// The default with a `logFile`: one line per step.
    Info,
    /// More detail.
    Debug,
    /// Everything.
    Trace,
}

impl LogLevel {
    /// Parses `error`, `warn`, `info`, `debug` or `trace`.
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "error" => Self::Error,
            "warn" => Self::Warn,
            "info" => Self::Info,
            "debug" => Self::Debug,
            "trace" => Self::Trace,
            _ => return None,
        })
    }

    /// The level as an `EnvFilter` directive.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Debug => "debug",
            Self::Trace => "trace",
        }
    }
}

/// A delegated IPAM plugin (`ipam.type`), run from `CNI_PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DelegatedIpam {
    /// The plugin's file name.
    pub plugin_type: String,
}

/// A named container port (`args.cni.containerPorts` /
/// `runtimeConfig.containerPorts`), for NetworkPolicy rules that name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPort {
    /// The port's name (an IANA service name).
    pub name: String,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// 1..65535.
    pub port: u16,
}

/// One attachment of GC's `cni.dev/valid-attachments`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attachment {
    /// `containerID`.
    pub container_id: String,
    /// `ifname`.
    pub ifname: String,
}

/// The parsed network configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// `cniVersion`.
    pub cni_version: CniVersion,
    /// `name`.
    pub name: String,
    /// `type`.
    pub plugin_type: String,
    /// `socketDir`: where `svc-ipam.sock` and `svc-endpoint.sock` are.
    pub socket_dir: PathBuf,
    /// `ipamPool`: the svc-ipam pool.
    pub ipam_pool: String,
    /// `hostInterfacePrefix`.
    pub host_interface_prefix: String,
    /// `mtu` of both ends of the veth.
    pub mtu: u32,
    /// `logFile`.
    pub log_file: Option<PathBuf>,
    /// `logLevel`, when given.
    pub log_level: Option<LogLevel>,
    /// `timeoutSeconds`.
    pub timeout: Duration,
    /// `ipam`: a delegated IPAM plugin instead of svc-ipam.
    pub ipam: Option<DelegatedIpam>,
    /// `prevResult`, as given.
    pub prev_result: Option<Value>,
    /// Pod labels from `args.cni.labels` and `runtimeConfig.labels`, as
    /// `source:key=value` (plain keys get source `k8s`), deduplicated.
    pub labels: Vec<String>,
    /// Requested addresses (`runtimeConfig.ips`, else `args.cni.ips`), at
    /// most one per family; svc-ipam allocates them if free.
    pub requested_ips: Vec<IpAddr>,
    /// Named container ports from `args.cni.containerPorts` and
    /// `runtimeConfig.containerPorts` (entries without a name are skipped).
    pub named_ports: Vec<NamedPort>,
    /// `dns`, copied into the result.
    pub dns: Option<Value>,
    /// GC's valid attachments (`cni.dev/valid-attachments`, or the older
    /// `cni.dev/attachments`); `None` when absent.
    pub valid_attachments: Option<Vec<Attachment>>,
    /// `endpointKind`: `pod` (the default) or `health`, the node's health
    /// endpoint, which `rivet node up` creates with a netconf of its own
    /// (svc-endpoint accepts it from root only, with no labels).
    pub endpoint_kind: EndpointKind,
    /// `tracing.otlpEndpoint`: where spans go over OTLP/gRPC
    /// (`http://host:port`); wins over the runtime's
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub otlp_endpoint: Option<String>,
}

/// What the interface is for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EndpointKind {
    /// A pod.
    #[default]
    Pod,
    /// The node's health endpoint (the reserved `health` identity).
    Health,
}

/// Where to log, read leniently from a netconf that may not parse, so that
/// even a rejected invocation is logged where the operator looks.
pub fn sniff_logging(stdin: &[u8]) -> (Option<PathBuf>, Option<LogLevel>) {
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(stdin) else {
        return (None, None);
    };
    let file = map
        .get("logFile")
        .and_then(Value::as_str)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let level = map.get("logLevel").and_then(Value::as_str).and_then(LogLevel::parse);
    (file, level)
}

/// `tracing.otlpEndpoint`, read before the netconf is parsed (the exporter
/// must exist before the invocation's first span); only a valid one, so a
/// netconf that [`NetConf::parse`] rejects for it exports nowhere.
pub fn sniff_otlp_endpoint(stdin: &[u8]) -> Option<String> {
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(stdin) else {
        return None;
    };
    parse_tracing(map.get("tracing")).ok().flatten()
}

/// The largest network configuration rivet-cni reads from stdin (1 MiB: a
/// netconf with a `prevResult` of every chained plugin is a few KiB). A
/// runtime sending more is refused before anything is parsed, so a huge or
/// endless stdin neither fills memory nor holds the plugin.
pub const STDIN_MAX: usize = 1 << 20;

/// Reads the invocation's stdin: at most [`STDIN_MAX`] bytes, or DECODE
/// (6) when there is more; IO_FAILURE (5) when reading fails.
///
/// ```
/// use rivet_cni::netconf::{read_stdin, STDIN_MAX};
/// assert_eq!(read_stdin(&b"{}"[..]).unwrap(), b"{}");
/// let huge = vec![b' '; STDIN_MAX + 1];
/// assert_eq!(read_stdin(&huge[..]).unwrap_err().code, 6);
/// ```
pub fn read_stdin(input: impl std::io::Read) -> Result<Vec<u8>, CniError> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    input
        .take(STDIN_MAX as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| CniError::new(codes::IO_FAILURE, format!("reading stdin: {e}")))?;
    if bytes.len() > STDIN_MAX {
        return Err(CniError::decode(format!(
            "the network configuration on stdin is larger than {STDIN_MAX} bytes; refusing to read it"
        )));
    }
    Ok(bytes)
}

/// The `cniVersion` of a netconf, if it names a supported one (for the error
/// result of an invocation whose netconf is otherwise invalid).
pub fn sniff_version(stdin: &[u8]) -> Option<CniVersion> {
    let value: Value = serde_json::from_slice(stdin).ok()?;
    CniVersion::parse(value.get("cniVersion")?.as_str()?)
}

impl NetConf {
    /// Parses and validates a netconf.
    ///
    /// ```
    /// let conf = rivet_cni::netconf::NetConf::parse(
    ///     br#"{"cniVersion":"1.0.0","name":"rivet","type":"rivet-cni","mtu":9000}"#,
    /// ).unwrap();
    /// assert_eq!(conf.mtu, 9000);
    /// assert_eq!(conf.ipam_pool, "default");
    /// ```
    pub fn parse(stdin: &[u8]) -> Result<Self, CniError> {
        let value: Value = serde_json::from_slice(stdin)
            .map_err(|e| CniError::decode(format!("decoding the network configuration on stdin: {e}")))?;
        let Value::Object(map) = value else {
            return Err(CniError::decode("the network configuration must be a JSON object"));
        };
        check_near_misses(&map)?;

        let cni_version = match map.get("cniVersion") {
            // Like the reference skeleton: no version means 0.1.0.
            None => return Err(version::unsupported("0.1.0")),
            Some(Value::String(v)) => CniVersion::parse(v).ok_or_else(|| version::unsupported(v))?,
            Some(other) => {
                return Err(CniError::decode(format!(
                    "cniVersion: expected a string, found {other}"
                )));
            }
        };
        let name = required_string(&map, "name")?;
        if !is_network_name(&name) {
            return Err(CniError::netconf(format!(
                "name={name:?}: must start with a letter or digit and contain only letters, digits, '_', '.' and '-'"
            )));
        }
        let plugin_type = required_string(&map, "type")?;

        let socket_dir = optional_string(&map, "socketDir")?
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET_DIR));
        if !socket_dir.is_absolute() {
            return Err(CniError::netconf(format!(
                "socketDir={:?}: must be an absolute path",
                socket_dir.display()
            )));
        }
        let ipam_pool = optional_string(&map, "ipamPool")?.unwrap_or_else(|| DEFAULT_IPAM_POOL.into());
        if ipam_pool.is_empty()
            || ipam_pool.len() > 63
            || !ipam_pool
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
        {
            return Err(CniError::netconf(format!(
                "ipamPool={ipam_pool:?}: must be 1 to 63 letters, digits, '_', '.' or '-'"
            )));
        }
        let host_interface_prefix =
            optional_string(&map, "hostInterfacePrefix")?.unwrap_or_else(|| DEFAULT_HOST_PREFIX.into());
        if host_interface_prefix.is_empty()
            || host_interface_prefix.len() > HOST_PREFIX_MAX
            || !host_interface_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
        {
            return Err(CniError::netconf(format!(
                "hostInterfacePrefix={host_interface_prefix:?}: must be 1 to {HOST_PREFIX_MAX} letters, digits, \
                 '_', '.' or '-'"
            )));
        }
        let mtu = match optional_u64(&map, "mtu")? {
            None => DEFAULT_MTU,
            Some(m) if (68..=65535).contains(&m) => m as u32,
            Some(m) => return Err(CniError::netconf(format!("mtu={m}: must be 68 to 65535"))),
        };
        let log_file = optional_string(&map, "logFile")?.map(PathBuf::from);
        if let Some(file) = &log_file
            && !file.is_absolute()
        {
            return Err(CniError::netconf(format!(
                "logFile={:?}: must be an absolute path",
                file.display()
            )));
        }
        let log_level = match optional_string(&map, "logLevel")? {
            None => None,
            Some(l) => Some(LogLevel::parse(&l).ok_or_else(|| {
                CniError::netconf(format!("logLevel={l:?}: must be error, warn, info, debug or trace"))
            })?),
        };
        let timeout_seconds = match optional_u64(&map, "timeoutSeconds")? {
            None => DEFAULT_TIMEOUT_SECONDS,
            Some(t) if (1..=MAX_TIMEOUT_SECONDS).contains(&t) => t,
            Some(t) => {
                return Err(CniError::netconf(format!(
                    "timeoutSeconds={t}: must be 1 to {MAX_TIMEOUT_SECONDS}"
                )));
            }
        };

        let ipam = parse_ipam(map.get("ipam"))?;
        let prev_result = match map.get("prevResult") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v.clone()),
            Some(other) => {
                return Err(CniError::decode(format!(
                    "prevResult: expected an object, found {other}"
                )));
            }
        };
        let dns = match map.get("dns") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v.clone()),
            Some(other) => return Err(CniError::netconf(format!("dns: expected an object, found {other}"))),
        };
        if let Some(masq) = map.get("ipMasq") {
            match masq {
                Value::Bool(false) => {}
                Value::Bool(true) => {
                    return Err(CniError::new(
                        codes::UNSUPPORTED_FIELD,
                        "unsupported field ipMasq=true: rivet-cni does not masquerade pod traffic",
                    ));
                }
                other => return Err(CniError::netconf(format!("ipMasq: expected a boolean, found {other}"))),
            }
        }

        let args = parse_args(map.get("args"))?;
        let runtime = parse_runtime_config(map.get("runtimeConfig"))?;
        let mut labels = args.labels;
        for label in runtime.labels {
            if !labels.contains(&label) {
                labels.push(label);
            }
        }
        let requested_ips = if runtime.ips.is_empty() { args.ips } else { runtime.ips };
        let named_ports = merge_named_ports(args.named_ports, runtime.named_ports)?;
        let valid_attachments = parse_attachments(&map)?;
        let endpoint_kind = match optional_string(&map, "endpointKind")?.as_deref() {
            None | Some("pod") => EndpointKind::Pod,
            Some("health") => EndpointKind::Health,
            Some(other) => {
                return Err(CniError::netconf(format!(
                    "endpointKind={other:?}: must be pod or health"
                )));
            }
        };
        let otlp_endpoint = parse_tracing(map.get("tracing"))?;
        if endpoint_kind == EndpointKind::Health && (!labels.is_empty() || !named_ports.is_empty()) {
            return Err(CniError::netconf(
                "endpointKind=health: the health endpoint takes no labels or container ports (its identity is \
                 reserved:health)",
            ));
        }

        Ok(Self {
            cni_version,
            name,
            plugin_type,
            socket_dir,
            ipam_pool,
            host_interface_prefix,
            mtu,
            log_file,
            log_level,
            timeout: Duration::from_secs(timeout_seconds),
            ipam,
            prev_result,
            labels,
            requested_ips,
            named_ports,
            dns,
            valid_attachments,
            endpoint_kind,
            otlp_endpoint,
        })
    }

    /// The svc-ipam socket.
    pub fn ipam_socket(&self) -> PathBuf {
        self.socket_dir.join("svc-ipam.sock")
    }

    /// The svc-endpoint socket.
    pub fn endpoint_socket(&self) -> PathBuf {
        self.socket_dir.join("svc-endpoint.sock")
    }
}

/// Lowercase, without `_`, `-` and `.`: how a near miss is recognised.
fn fold(key: &str) -> String {
    key.chars()
        .filter(|c| !matches!(c, '_' | '-' | '.'))
        .flat_map(char::to_lowercase)
        .collect()
}

fn check_near_misses(map: &Map<String, Value>) -> Result<(), CniError> {
    for (key, value) in map {
        if RIVET_KEYS.contains(&key.as_str()) || SPEC_KEYS.contains(&key.as_str()) {
            continue;
        }
        let folded = fold(key);
        if let Some(known) = RIVET_KEYS.iter().chain(SPEC_KEYS).find(|k| fold(k) == folded) {
            return Err(CniError::new(
                codes::UNSUPPORTED_FIELD,
                format!("unsupported field {key}={value}: did you mean {known}?"),
            ));
        }
    }
    Ok(())
}

fn is_network_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

fn required_string(map: &Map<String, Value>, key: &str) -> Result<String, CniError> {
    match optional_string(map, key)? {
        Some(s) if !s.is_empty() => Ok(s),
        _ => Err(CniError::netconf(format!("{key}: required"))),
    }
}

fn optional_string(map: &Map<String, Value>, key: &str) -> Result<Option<String>, CniError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            if s.chars().any(char::is_control) {
                return Err(CniError::netconf(format!("{key}: must not contain control characters")));
            }
            Ok(Some(s.clone()))
        }
        Some(other) => Err(CniError::netconf(format!("{key}: expected a string, found {other}"))),
    }
}

fn optional_u64(map: &Map<String, Value>, key: &str) -> Result<Option<u64>, CniError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| CniError::netconf(format!("{key}={n}: expected a non-negative integer"))),
        Some(other) => Err(CniError::netconf(format!("{key}: expected a number, found {other}"))),
    }
}

/// `tracing`: an object with Rivet's keys only ([`TRACING_KEYS`]);
/// `otlpEndpoint` is `http://` or `https://`, a host, an optional port and
/// no path (OTLP/gRPC has none), as the exporter takes it.
fn parse_tracing(value: Option<&Value>) -> Result<Option<String>, CniError> {
    let map = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(other) => return Err(CniError::netconf(format!("tracing: expected an object, found {other}"))),
    };
    if let Some(key) = map.keys().find(|k| !TRACING_KEYS.contains(&k.as_str())) {
        return Err(CniError::new(
            codes::UNSUPPORTED_FIELD,
            format!(
                "unsupported field tracing.{key}: tracing takes {}",
                TRACING_KEYS.join(", ")
            ),
        ));
    }
    let endpoint = match map.get("otlpEndpoint") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s,
        Some(other) => {
            return Err(CniError::netconf(format!(
                "tracing.otlpEndpoint: expected a string, found {other}"
            )));
        }
    };
    check_otlp_endpoint(endpoint)
        .map_err(|why| CniError::netconf(format!("tracing.otlpEndpoint={endpoint:?}: {why}")))?;
    Ok(Some(endpoint.clone()))
}

/// `http[s]://host[:port][/]`: what an OTLP/gRPC exporter dials; `Err`
/// says what is wrong.
///
/// ```
/// use rivet_cni::netconf::check_otlp_endpoint;
/// assert!(check_otlp_endpoint("http://198.19.255.10:4317").is_ok());
/// assert!(check_otlp_endpoint("198.19.255.10:4317").is_err());
/// ```
pub fn check_otlp_endpoint(endpoint: &str) -> Result<(), &'static str> {
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .ok_or("must start with http:// or https://")?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() {
        return Err("must name a host");
    }
    if authority.contains(['/', '?', '#', '@']) || authority.chars().any(char::is_whitespace) {
        return Err("must be a scheme, a host and a port, with no path, query or user");
    }
    // `[v6]:port`, `host:port` or a bare host.
    let port = match authority.strip_prefix('[') {
        Some(v6) => {
            let (address, after) = v6.split_once(']').ok_or("an IPv6 address needs its closing ]")?;
            address
                .parse::<std::net::Ipv6Addr>()
                .map_err(|_| "not an IPv6 address in [ ]")?;
            match after {
                "" => None,
                port => Some(port.strip_prefix(':').ok_or("only :port may follow ]")?),
            }
        }
        None => match authority.split_once(':') {
            Some((host, port)) => {
                if host.is_empty() {
                    return Err("must name a host");
                }
                Some(port)
            }
            None => None,
        },
    };
    if let Some(port) = port
        && !port.parse::<u16>().is_ok_and(|p| p != 0)
    {
        return Err("the port must be 1 to 65535");
    }
    Ok(())
}

fn parse_ipam(value: Option<&Value>) -> Result<Option<DelegatedIpam>, CniError> {
    let map = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) if m.is_empty() => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(other) => return Err(CniError::netconf(format!("ipam: expected an object, found {other}"))),
    };
    let plugin_type = match map.get("type") {
        Some(Value::String(t)) if !t.is_empty() => t.clone(),
        _ => return Err(CniError::netconf("ipam.type: required (the delegated IPAM plugin)")),
    };
    if plugin_type.contains('/') || plugin_type == "." || plugin_type == ".." {
        return Err(CniError::netconf(format!(
            "ipam.type={plugin_type:?}: must be a plugin file name, not a path"
        )));
    }
    Ok(Some(DelegatedIpam { plugin_type }))
}

/// What `args.cni` or `runtimeConfig` says about the pod.
#[derive(Debug, Default)]
struct PodArgs {
    labels: Vec<String>,
    ips: Vec<IpAddr>,
    named_ports: Vec<NamedPort>,
}

impl PodArgs {
    /// `labels`, `ips` and `containerPorts` of `map`, named `field.<key>` in errors.
    fn parse(field: &str, map: &Map<String, Value>) -> Result<Self, CniError> {
        Ok(Self {
            labels: parse_labels(&format!("{field}.labels"), map.get("labels"))?,
            ips: parse_ips(&format!("{field}.ips"), map.get("ips"))?,
            named_ports: parse_container_ports(&format!("{field}.containerPorts"), map.get("containerPorts"))?,
        })
    }
}

/// `args.cni.labels`, `args.cni.ips` and `args.cni.containerPorts`; other
/// keys of `args` belong to others and are ignored (the spec says so).
fn parse_args(value: Option<&Value>) -> Result<PodArgs, CniError> {
    let Some(Value::Object(args)) = value else {
        return match value {
            None | Some(Value::Null) => Ok(PodArgs::default()),
            Some(other) => Err(CniError::netconf(format!("args: expected an object, found {other}"))),
        };
    };
    match args.get("cni") {
        None | Some(Value::Null) => Ok(PodArgs::default()),
        Some(Value::Object(cni)) => PodArgs::parse("args.cni", cni),
        Some(other) => Err(CniError::netconf(format!(
            "args.cni: expected an object, found {other}"
        ))),
    }
}

/// `runtimeConfig.labels`, `runtimeConfig.ips` and
/// `runtimeConfig.containerPorts`; other capabilities are not rivet-cni's.
fn parse_runtime_config(value: Option<&Value>) -> Result<PodArgs, CniError> {
    match value {
        None | Some(Value::Null) => Ok(PodArgs::default()),
        Some(Value::Object(rc)) => PodArgs::parse("runtimeConfig", rc),
        Some(other) => Err(CniError::netconf(format!(
            "runtimeConfig: expected an object, found {other}"
        ))),
    }
}

/// The items of an optional list (missing or `null`: none); anything else
/// than a list is an error naming `field`.
fn optional_list<'a>(field: &str, value: Option<&'a Value>) -> Result<&'a [Value], CniError> {
    match value {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) => Ok(items),
        Some(other) => Err(CniError::netconf(format!("{field}: expected a list, found {other}"))),
    }
}

/// Keys of a `containerPorts` entry: Kubernetes' ContainerPort. `hostPort`
/// and `hostIP` are a port-mapping plugin's business and ignored here.
const CONTAINER_PORT_KEYS: &[&str] = &["name", "containerPort", "protocol", "hostPort", "hostIP"];

/// A list of Kubernetes ContainerPort objects (`{"name": "http",
/// "containerPort": 8080, "protocol": "TCP"}`, protocol default TCP); the
/// named ones, each name once.
fn parse_container_ports(field: &str, value: Option<&Value>) -> Result<Vec<NamedPort>, CniError> {
    let items = optional_list(field, value)?;
    let mut ports: Vec<NamedPort> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let entry = format!("{field}[{i}]");
        let Value::Object(map) = item else {
            return Err(CniError::netconf(format!(
                "{entry}: expected a ContainerPort object, found {item}"
            )));
        };
        if let Some(key) = map.keys().find(|k| !CONTAINER_PORT_KEYS.contains(&k.as_str())) {
            return Err(CniError::netconf(format!(
                "{entry}.{key}: unknown key (a ContainerPort has {})",
                CONTAINER_PORT_KEYS.join(", ")
            )));
        }
        let port = match map.get("containerPort") {
            Some(Value::Number(n)) => n.as_u64().and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0),
            _ => None,
        }
        .ok_or_else(|| CniError::netconf(format!("{entry}.containerPort: required, 1 to 65535")))?;
        let protocol = match map.get("protocol") {
            None | Some(Value::Null) => "TCP".to_string(),
            Some(Value::String(p)) if matches!(p.as_str(), "TCP" | "UDP" | "SCTP") => p.clone(),
            Some(other) => {
                return Err(CniError::netconf(format!(
                    "{entry}.protocol={other}: must be TCP, UDP or SCTP"
                )));
            }
        };
        let name = match map.get("name") {
            // An unnamed port is allowed in a ContainerPort list; no rule can name it.
            None | Some(Value::Null) => continue,
            Some(Value::String(n)) if n.is_empty() => continue,
            Some(Value::String(n)) => n.clone(),
            Some(other) => {
                return Err(CniError::netconf(format!(
                    "{entry}.name: expected a string, found {other}"
                )));
            }
        };
        rivet_common::named_port::check_port_name(&name)
            .map_err(|e| CniError::netconf(format!("{entry}.name: {e}")))?;
        if ports.iter().any(|p| p.name == name) {
            return Err(CniError::netconf(format!(
                "{entry}.name: port name {name:?} is given twice"
            )));
        }
        ports.push(NamedPort { name, protocol, port });
    }
    Ok(ports)
}

/// The ports of `args.cni` and `runtimeConfig` together: one name defined
/// in both must mean the same port.
fn merge_named_ports(args: Vec<NamedPort>, runtime: Vec<NamedPort>) -> Result<Vec<NamedPort>, CniError> {
    let mut ports = runtime;
    for port in args {
        match ports.iter().find(|p| p.name == port.name) {
            None => ports.push(port),
            Some(same) if *same == port => {}
            Some(other) => {
                return Err(CniError::netconf(format!(
                    "containerPorts: port {:?} is {}/{} in runtimeConfig but {}/{} in args.cni",
                    port.name, other.protocol, other.port, port.protocol, port.port
                )));
            }
        }
    }
    Ok(ports)
}

/// A list of `source:key=value` / `key=value` strings, or of the
/// conventions' `{"key": ..., "value": ...}` objects.
fn parse_labels(field: &str, value: Option<&Value>) -> Result<Vec<String>, CniError> {
    let items = optional_list(field, value)?;
    let mut labels = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let text = match item {
            Value::String(s) => s.clone(),
            Value::Object(o) => match (o.get("key"), o.get("value")) {
                (Some(Value::String(k)), Some(Value::String(v))) => format!("{k}={v}"),
                (Some(Value::String(k)), None) => k.clone(),
                _ => {
                    return Err(CniError::netconf(format!(
                        "{field}[{i}]: a label object needs string \"key\" and \"value\""
                    )));
                }
            },
            other => {
                return Err(CniError::netconf(format!(
                    "{field}[{i}]: expected a label string, found {other}"
                )));
            }
        };
        let label = normalize_label(&text).map_err(|e| CniError::netconf(format!("{field}[{i}]: {e}")))?;
        if !labels.contains(&label) {
            labels.push(label);
        }
    }
    Ok(labels)
}

/// `source:key=value` stays, `key=value` becomes `k8s:key=value`; only pod
/// label sources (`k8s`, `container`, `unspec`) are accepted.
///
/// ```
/// use rivet_cni::netconf::normalize_label;
/// assert_eq!(normalize_label("app=web").unwrap(), "k8s:app=web");
/// assert_eq!(normalize_label("container:tier=db").unwrap(), "container:tier=db");
/// assert!(normalize_label("reserved:host").is_err());
/// ```
pub fn normalize_label(text: &str) -> Result<String, String> {
    let has_source = match (text.find(':'), text.find('=')) {
        (Some(colon), Some(eq)) => colon < eq,
        (Some(_), None) => true,
        _ => false,
    };
    let full = if has_source {
        text.to_string()
    } else {
        format!("k8s:{text}")
    };
    let label: Label = full.parse().map_err(|e| format!("{e}"))?;
    match label.source() {
        LabelSource::K8s | LabelSource::Container | LabelSource::Unspec => Ok(label.to_string()),
        other => Err(format!(
            "label {text:?}: source {other} is not a pod label source (k8s, container, unspec)"
        )),
    }
}

fn parse_ips(field: &str, value: Option<&Value>) -> Result<Vec<IpAddr>, CniError> {
    let items = optional_list(field, value)?;
    let mut ips: Vec<IpAddr> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let text = item
            .as_str()
            .ok_or_else(|| CniError::netconf(format!("{field}[{i}]: expected an address string, found {item}")))?;
        let address = text.split_once('/').map_or(text, |(a, _)| a);
        let ip: IpAddr = address
            .parse()
            .map_err(|_| CniError::netconf(format!("{field}[{i}]={text:?}: not an IP address")))?;
        if ips.iter().any(|o| o.is_ipv4() == ip.is_ipv4()) {
            return Err(CniError::netconf(format!("{field}: at most one address per family")));
        }
        ips.push(ip);
    }
    Ok(ips)
}

fn parse_attachments(map: &Map<String, Value>) -> Result<Option<Vec<Attachment>>, CniError> {
    let (field, value) = match (map.get("cni.dev/valid-attachments"), map.get("cni.dev/attachments")) {
        (Some(v), _) if !v.is_null() => ("cni.dev/valid-attachments", v),
        (_, Some(v)) if !v.is_null() => ("cni.dev/attachments", v),
        _ => return Ok(None),
    };
    let items = value
        .as_array()
        .ok_or_else(|| CniError::netconf(format!("{field}: expected a list, found {value}")))?;
    let mut attachments = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let get = |key: &str| item.get(key).and_then(Value::as_str).filter(|s| !s.is_empty());
        match (get("containerID"), get("ifname")) {
            (Some(container_id), Some(ifname)) => {
                check_ifname(ifname).map_err(|e| CniError::netconf(format!("{field}[{i}].ifname: {e}")))?;
                attachments.push(Attachment {
                    container_id: container_id.to_string(),
                    ifname: ifname.to_string(),
                });
            }
            _ => {
                return Err(CniError::netconf(format!(
                    "{field}[{i}]: needs string \"containerID\" and \"ifname\", found {item}"
                )));
            }
        }
    }
    Ok(Some(attachments))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse(value: Value) -> Result<NetConf, CniError> {
        NetConf::parse(value.to_string().as_bytes())
    }

    fn base() -> Value {
        json!({"cniVersion": "1.1.0", "name": "rivet", "type": "rivet-cni"})
    }

    fn with(key: &str, value: Value) -> Value {
        let mut v = base();
        v[key] = value;
        v
    }

    fn code(value: Value) -> u32 {
        parse(value).unwrap_err().code
    }

    #[test]
    fn defaults() {
        let c = parse(base()).unwrap();
        assert_eq!(c.cni_version, CniVersion::V1_1_0);
        assert_eq!(c.socket_dir, PathBuf::from(DEFAULT_SOCKET_DIR));
        assert_eq!(c.ipam_pool, "default");
        assert_eq!(c.host_interface_prefix, "lxc");
        assert_eq!(c.mtu, 1500);
        assert_eq!(c.timeout, Duration::from_secs(30));
        assert_eq!(c.log_file, None);
        assert_eq!(c.log_level, None);
        assert_eq!(c.ipam, None);
        assert_eq!(c.prev_result, None);
        assert!(c.labels.is_empty() && c.requested_ips.is_empty());
        assert_eq!(c.valid_attachments, None);
        assert_eq!(c.ipam_socket(), PathBuf::from("/var/run/rivet/sockets/svc-ipam.sock"));
    }

    #[test]
    fn the_health_endpoint_kind_takes_no_labels() {
        assert_eq!(parse(base()).unwrap().endpoint_kind, EndpointKind::Pod);
        assert_eq!(
            parse(with("endpointKind", json!("health"))).unwrap().endpoint_kind,
            EndpointKind::Health
        );
        assert_eq!(code(with("endpointKind", json!("router"))), codes::INVALID_NETCONF);
        let mut labelled = with("endpointKind", json!("health"));
        labelled["args"] = json!({"cni": {"labels": [{"key": "app", "value": "web"}]}});
        let e = parse(labelled).unwrap_err();
        assert_eq!(e.code, codes::INVALID_NETCONF);
        assert!(e.msg.contains("endpointKind=health"), "{}", e.msg);
    }

    #[test]
    fn every_supported_version_parses() {
        for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
            assert_eq!(parse(with("cniVersion", json!(v))).unwrap().cni_version.as_str(), v);
        }
        for v in ["0.1.0", "0.2.0", "1.2.0", "2.0.0", "1.0"] {
            assert_eq!(code(with("cniVersion", json!(v))), codes::INCOMPATIBLE_VERSION, "{v}");
        }
        let mut no_version = base();
        no_version.as_object_mut().unwrap().remove("cniVersion");
        assert_eq!(code(no_version), codes::INCOMPATIBLE_VERSION);
        assert_eq!(code(with("cniVersion", json!(1))), codes::DECODE);
    }

    #[test]
    fn rivet_keys() {
        let c = parse(json!({
            "cniVersion": "0.4.0", "name": "n", "type": "rivet-cni",
            "socketDir": "/run/r", "ipamPool": "blue", "hostInterfacePrefix": "rvh",
            "mtu": 9000, "logFile": "/var/log/rivet-cni.log", "logLevel": "debug", "timeoutSeconds": 5,
        }))
        .unwrap();
        assert_eq!(c.socket_dir, PathBuf::from("/run/r"));
        assert_eq!(c.endpoint_socket(), PathBuf::from("/run/r/svc-endpoint.sock"));
        assert_eq!(c.ipam_pool, "blue");
        assert_eq!(c.host_interface_prefix, "rvh");
        assert_eq!(c.mtu, 9000);
        assert_eq!(c.log_file, Some(PathBuf::from("/var/log/rivet-cni.log")));
        assert_eq!(c.log_level, Some(LogLevel::Debug));
        assert_eq!(c.timeout, Duration::from_secs(5));
    }

    #[test]
    fn invalid_rivet_values_are_invalid_netconf() {
        for (key, value) in [
            ("socketDir", json!("relative/dir")),
            ("socketDir", json!(5)),
            ("ipamPool", json!("")),
            ("ipamPool", json!("a b")),
            ("hostInterfacePrefix", json!("")),
            ("hostInterfacePrefix", json!("elevenbytes")),
            ("hostInterfacePrefix", json!("a/b")),
            ("mtu", json!(67)),
            ("mtu", json!(70000)),
            ("mtu", json!(1500.5)),
            ("mtu", json!("1500")),
            ("logFile", json!("rel.log")),
            ("logLevel", json!("verbose")),
            ("timeoutSeconds", json!(0)),
            ("timeoutSeconds", json!(-1)),
            ("timeoutSeconds", json!(3601)),
            ("ipam", json!("host-local")),
            ("ipam", json!({"subnet": "198.18.0.0/24"})),
            ("ipam", json!({"type": "../evil"})),
            ("dns", json!([])),
            ("args", json!("x")),
            ("args", json!({"cni": []})),
            ("args", json!({"cni": {"labels": "app=web"}})),
            ("args", json!({"cni": {"labels": [5]}})),
            ("args", json!({"cni": {"labels": ["reserved:host"]}})),
            ("args", json!({"cni": {"labels": ["app=we b"]}})),
            ("args", json!({"cni": {"ips": ["nope"]}})),
            ("args", json!({"cni": {"ips": ["198.18.0.5", "198.18.0.6"]}})),
            ("runtimeConfig", json!([])),
            ("cni.dev/valid-attachments", json!([{"containerID": "a"}])),
            ("cni.dev/valid-attachments", json!({})),
            ("name", json!("-bad")),
            ("type", json!("")),
        ] {
            let err = parse(with(key, value.clone())).unwrap_err();
            assert_eq!(err.code, codes::INVALID_NETCONF, "{key}={value}: {err}");
            assert!(err.msg.contains(key.split('.').next().unwrap()), "{err} names {key}");
        }
        assert_eq!(code(with("prevResult", json!([]))), codes::DECODE);
    }

    #[test]
    fn unknown_and_near_miss_keys() {
        // Other tools' keys are fine.
        assert!(parse(with("bandwidth", json!({"x": 1}))).is_ok());
        assert!(parse(with("capabilities", json!({"ips": true}))).is_ok());
        for key in [
            "socketdir",
            "socket_dir",
            "SocketDir",
            "MTU",
            "ipam-pool",
            "timeout_seconds",
            "cniversion",
        ] {
            let err = parse(with(key, json!("x"))).unwrap_err();
            assert_eq!(err.code, codes::UNSUPPORTED_FIELD, "{key}");
            assert!(err.msg.contains(key) && err.msg.contains("\"x\""), "{err}");
            assert!(err.msg.contains("did you mean"), "{err}");
        }
        let err = parse(with("ipMasq", json!(true))).unwrap_err();
        assert_eq!(err.code, codes::UNSUPPORTED_FIELD);
        assert!(err.msg.contains("ipMasq=true"));
        assert!(parse(with("ipMasq", json!(false))).is_ok());
    }

    #[test]
    fn malformed_json_is_a_decode_error() {
        for text in ["", "{", "[]", "null", "\"x\"", "{\"cniVersion\": \"1.0.0\",}"] {
            assert_eq!(
                NetConf::parse(text.as_bytes()).unwrap_err().code,
                codes::DECODE,
                "{text:?}"
            );
        }
    }

    #[test]
    fn labels_from_args_and_runtime_config() {
        let c = parse(json!({
            "cniVersion": "1.0.0", "name": "n", "type": "rivet-cni",
            "args": {"cni": {"labels": ["app=web", "container:tier=front", {"key": "team", "value": "a"}, "app=web"],
                             "other": 1},
                     "labels": {"appVersion": "1.0"}},
            "runtimeConfig": {"labels": ["k8s:app=web", "zone=b"], "portMappings": []},
        }))
        .unwrap();
        assert_eq!(
            c.labels,
            ["k8s:app=web", "container:tier=front", "k8s:team=a", "k8s:zone=b"]
        );
    }

    #[test]
    fn named_ports_from_args_and_runtime_config() {
        let mut v = with(
            "args",
            json!({"cni": {"containerPorts": [
                {"name": "http", "containerPort": 8080},
                {"containerPort": 9000},
                {"name": "dns", "containerPort": 53, "protocol": "UDP", "hostPort": 5353},
            ]}}),
        );
        v["runtimeConfig"] = json!({"containerPorts": [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                                                        {"name": "assoc", "containerPort": 7, "protocol": "SCTP"}]});
        let port = |name: &str, protocol: &str, port: u16| NamedPort {
            name: name.into(),
            protocol: protocol.into(),
            port,
        };
        assert_eq!(
            parse(v).unwrap().named_ports,
            [
                port("http", "TCP", 8080),
                port("assoc", "SCTP", 7),
                port("dns", "UDP", 53)
            ]
        );
        assert!(parse(base()).unwrap().named_ports.is_empty());
        // One name, two meanings.
        let mut v = with(
            "args",
            json!({"cni": {"containerPorts": [{"name": "http", "containerPort": 80}]}}),
        );
        v["runtimeConfig"] = json!({"containerPorts": [{"name": "http", "containerPort": 8080}]});
        let err = parse(v).unwrap_err();
        assert_eq!(err.code, codes::INVALID_NETCONF);
        assert!(
            err.msg.contains("\"http\" is TCP/8080 in runtimeConfig but TCP/80"),
            "{err}"
        );
        for (ports, says) in [
            (json!("http=80"), "args.cni.containerPorts: expected a list"),
            (json!(["http"]), "args.cni.containerPorts[0]: expected a ContainerPort"),
            (
                json!([{"name": "http"}]),
                "args.cni.containerPorts[0].containerPort: required",
            ),
            (
                json!([{"name": "http", "containerPort": 0}]),
                "containerPort: required, 1 to 65535",
            ),
            (
                json!([{"name": "http", "containerPort": 70000}]),
                "containerPort: required",
            ),
            (
                json!([{"name": "http", "containerPort": "80"}]),
                "containerPort: required",
            ),
            (
                json!([{"name": "http", "containerPort": 80, "protocol": "tcp"}]),
                "protocol=\"tcp\": must be TCP, UDP or SCTP",
            ),
            (
                json!([{"name": "HTTP", "containerPort": 80}]),
                "[0].name: \"HTTP\" is not a valid port name",
            ),
            (json!([{"name": "80", "containerPort": 80}]), "not a valid port name"),
            (json!([{"name": 5, "containerPort": 80}]), "name: expected a string"),
            (
                json!([{"name": "a", "containerPort": 1}, {"name": "a", "containerPort": 2}]),
                "[1].name: port name \"a\" is given twice",
            ),
            (
                json!([{"name": "a", "containerPort": 1, "port": 2}]),
                "[0].port: unknown key",
            ),
        ] {
            let err = parse(with("args", json!({"cni": {"containerPorts": ports.clone()}}))).unwrap_err();
            assert_eq!(err.code, codes::INVALID_NETCONF, "{ports}");
            assert!(err.msg.contains(says), "{ports}: {err}");
        }
    }

    #[test]
    fn requested_ips() {
        let c = parse(with("args", json!({"cni": {"ips": ["198.18.0.9/22", "2001:2::9"]}}))).unwrap();
        assert_eq!(
            c.requested_ips,
            ["198.18.0.9".parse::<IpAddr>().unwrap(), "2001:2::9".parse().unwrap()]
        );
        let mut v = with("args", json!({"cni": {"ips": ["198.18.0.9"]}}));
        v["runtimeConfig"] = json!({"ips": ["198.18.0.10"]});
        assert_eq!(
            parse(v).unwrap().requested_ips,
            ["198.18.0.10".parse::<IpAddr>().unwrap()]
        );
    }

    #[test]
    fn delegated_ipam_and_prev_result() {
        let c = parse(with("ipam", json!({"type": "host-local", "subnet": "198.18.4.0/24"}))).unwrap();
        assert_eq!(
            c.ipam,
            Some(DelegatedIpam {
                plugin_type: "host-local".into()
            })
        );
        assert_eq!(parse(with("ipam", json!({}))).unwrap().ipam, None);
        let prev = json!({"cniVersion": "1.1.0", "interfaces": []});
        assert_eq!(parse(with("prevResult", prev.clone())).unwrap().prev_result, Some(prev));
    }

    #[test]
    fn gc_attachments() {
        let list = json!([{"containerID": "a", "ifname": "eth0"}, {"containerID": "b", "ifname": "net1"}]);
        let c = parse(with("cni.dev/valid-attachments", list.clone())).unwrap();
        assert_eq!(c.valid_attachments.as_ref().unwrap().len(), 2);
        assert_eq!(c.valid_attachments.unwrap()[1].ifname, "net1");
        // The spec's earlier spelling.
        let c = parse(with("cni.dev/attachments", list)).unwrap();
        assert_eq!(c.valid_attachments.unwrap()[0].container_id, "a");
        assert_eq!(
            parse(with("cni.dev/valid-attachments", json!([])))
                .unwrap()
                .valid_attachments,
            Some(vec![])
        );
    }

    #[test]
    fn sniffing() {
        let text = br#"{"cniVersion": "0.4.0", "logFile": "/tmp/x.log", "logLevel": "debug", "mtu": "bad"}"#;
        assert_eq!(
            sniff_logging(text),
            (Some(PathBuf::from("/tmp/x.log")), Some(LogLevel::Debug))
        );
        assert_eq!(sniff_version(text), Some(CniVersion::V0_4_0));
        assert_eq!(sniff_logging(b"garbage"), (None, None));
        assert_eq!(sniff_version(br#"{"cniVersion": "9"}"#), None);
    }

    #[test]
    fn tracing_names_a_valid_otlp_endpoint() {
        assert_eq!(parse(base()).unwrap().otlp_endpoint, None);
        for good in [
            "http://198.19.255.10:4317",
            "https://jaeger.kube-system:4317/",
            "http://[2001:2::1]:4317",
            "http://localhost",
        ] {
            let conf = parse(with("tracing", json!({"otlpEndpoint": good}))).unwrap_or_else(|e| panic!("{good}: {e}"));
            assert_eq!(conf.otlp_endpoint.as_deref(), Some(good));
            let text = with("tracing", json!({"otlpEndpoint": good})).to_string();
            assert_eq!(sniff_otlp_endpoint(text.as_bytes()).as_deref(), Some(good));
        }
        for (tracing, code, says) in [
            (
                json!("http://x:4317"),
                codes::INVALID_NETCONF,
                "tracing: expected an object",
            ),
            (
                json!({"otlpEndpoint": 4317}),
                codes::INVALID_NETCONF,
                "tracing.otlpEndpoint: expected a string",
            ),
            (
                json!({"otlpEndpoint": "x:4317"}),
                codes::INVALID_NETCONF,
                "must start with http:// or https://",
            ),
            (
                json!({"otlpEndpoint": "grpc://x:4317"}),
                codes::INVALID_NETCONF,
                "must start with http://",
            ),
            (
                json!({"otlpEndpoint": "http://"}),
                codes::INVALID_NETCONF,
                "must name a host",
            ),
            (
                json!({"otlpEndpoint": "http://:4317"}),
                codes::INVALID_NETCONF,
                "must name a host",
            ),
            (
                json!({"otlpEndpoint": "http://x:0"}),
                codes::INVALID_NETCONF,
                "the port must be 1 to 65535",
            ),
            (
                json!({"otlpEndpoint": "http://x:99999"}),
                codes::INVALID_NETCONF,
                "the port must be",
            ),
            (
                json!({"otlpEndpoint": "http://x:4317/v1/traces"}),
                codes::INVALID_NETCONF,
                "no path",
            ),
            (
                json!({"otlpEndpoint": "http://[2001:2::1:4317"}),
                codes::INVALID_NETCONF,
                "closing ]",
            ),
            (
                json!({"otlpEndpoint": "http://[x]:4317"}),
                codes::INVALID_NETCONF,
                "not an IPv6 address",
            ),
            (
                json!({"otlpEndpoint": "http://x:4317", "serviceName": "y"}),
                codes::UNSUPPORTED_FIELD,
                "unsupported field tracing.serviceName",
            ),
        ] {
            let err = parse(with("tracing", tracing.clone())).unwrap_err();
            assert_eq!(err.code, code, "{tracing}: {err}");
            assert!(err.msg.contains(says), "{tracing}: {err}");
            // What parse refuses exports nowhere.
            let text = with("tracing", tracing.clone()).to_string();
            assert_eq!(sniff_otlp_endpoint(text.as_bytes()), None, "{tracing}");
        }
        // A near miss of the key is caught like the others.
        let err = parse(with("Tracing", json!({}))).unwrap_err();
        assert!(err.msg.contains("did you mean tracing?"), "{err}");
    }
}
