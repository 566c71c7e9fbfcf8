//! A real Jaeger v2 (the all-in-one built by `cargo xtask install`) for the
//! trace tests: started on free 127.0.0.1 ports with memory storage, its
//! OTLP/gRPC endpoint handed to the daemons, traces read back through its
//! query API (`/api/v3/traces`, OTLP JSON) as typed [`JaegerSpan`]s.
//!
//! Processes in a node network namespace cannot reach the host's loopback;
//! [`Jaeger::relay_into`] opens a TCP relay whose listener lives inside that
//! namespace and forwards to Jaeger's OTLP port, so one Jaeger sees the spans
//! of every process. Jaeger, its temp dir and each relay are removed on drop.
//!
//! ```no_run
//! # async fn t() -> Result<(), rivet_testkit::jaeger::JaegerError> {
//! use std::time::Duration;
//! use rivet_testkit::jaeger::Jaeger;
//!
//! let jaeger = Jaeger::start().await?;
//! // OTEL_EXPORTER_OTLP_ENDPOINT=<jaeger.otlp_endpoint()> for every daemon ...
//! let spans = jaeger
//!     .wait_for_service("svc-ipam", Duration::from_secs(10), |spans| {
//!         spans.iter().any(|s| s.name == "ipam.allocate")
//!     })
//!     .await?;
//! assert!(spans.iter().any(|s| s.name == "ipam.allocate"), "{spans:#?}");
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdTcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;
use rivet_common::testing::netns::{NetNs, NetnsError};
use serde::Deserialize;
use tokio::sync::oneshot;

use crate::tools::{Tool, ToolError, tool_path};

/// How long Jaeger may take to report healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How often readiness and the query API are polled.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Starts retried when another process took a port between picking and binding.
const START_ATTEMPTS: usize = 3;

/// Why the Jaeger fixture failed.
#[derive(Debug, thiserror::Error)]
pub enum JaegerError {
    /// The binary is not installed (the error names the version and
    /// `cargo xtask install`).
    #[error(transparent)]
    Missing(#[from] ToolError),
    /// A file or socket operation of the fixture failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Jaeger exited or did not report healthy in time.
    #[error("Jaeger ({}) did not become ready ({reason}); its log:\n{log}", Tool::Jaeger.set().version)]
    NotReady {
        /// Exited (with its status) or timed out.
        reason: String,
        /// Its stderr.
        log: String,
    },
    /// A query API request failed.
    #[error("GET {path} on Jaeger's query API: {reason}")]
    Query {
        /// The request path.
        path: String,
        /// What went wrong (transport, status, body).
        reason: String,
    },
    /// The relay into a namespace could not be set up.
    #[error("relaying OTLP into namespace {namespace}")]
    Relay {
        /// The namespace.
        namespace: String,
        /// The error.
        #[source]
        source: NetnsError,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> JaegerError {
    let context = context.into();
    move |source| JaegerError::Io { context, source }
}

/// The ports one Jaeger listens on, all on 127.0.0.1.
#[derive(Debug, Clone, Copy)]
struct Ports {
    otlp_grpc: u16,
    query_http: u16,
    query_grpc: u16,
    health: u16,
}

impl Ports {
    /// Four ports that were free a moment ago (bound together, so distinct).
    fn pick() -> Result<Self, JaegerError> {
        let bind = || StdTcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io("binding 127.0.0.1:0 for a free port"));
        let held = [bind()?, bind()?, bind()?, bind()?];
        let port = |i: usize| {
            held[i]
                .local_addr()
                .map(|a| a.port())
                .map_err(io("reading a bound port"))
        };
        Ok(Self {
            otlp_grpc: port(0)?,
            query_http: port(1)?,
            query_grpc: port(2)?,
            health: port(3)?,
        })
    }

    /// The minimal configuration: OTLP/gRPC in, memory storage, the query
    /// API, the health check; no other receiver, no own metrics listener.
    fn config(&self) -> String {
        let Self {
            otlp_grpc,
            query_http,
            query_grpc,
            health,
        } = self;
        format!(
            r#"service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query_http}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:{health}
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{otlp_grpc}
processors:
  batch:
    timeout: 50ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"#
        )
    }
}

/// A running Jaeger, killed and its temp dir removed on drop.
#[derive(Debug)]
pub struct Jaeger {
    child: Child,
    dir: tempfile::TempDir,
    ports: Ports,
    /// Queries look for traces started after this (less a minute).
    started: SystemTime,
}

impl Jaeger {
    /// Starts Jaeger with a config bound to 127.0.0.1 only and waits until
    /// its health check says every component is up.
    pub async fn start() -> Result<Self, JaegerError> {
        let binary = tool_path(Tool::Jaeger)?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(&binary).await {
                Err(JaegerError::NotReady { log, .. })
                    if attempt < START_ATTEMPTS && log.contains("address already in use") =>
                {
                    continue;
                }
                result => return result,
            }
        }
    }

    async fn start_once(binary: &Path) -> Result<Self, JaegerError> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("rivet-jaeger-{}-", std::process::id()))
            .tempdir()
            .map_err(io("creating Jaeger's temp dir"))?;
        let ports = Ports::pick()?;
        let config = dir.path().join("config.yaml");
        std::fs::write(&config, ports.config()).map_err(io(format!("writing {}", config.display())))?;
        let log_path = dir.path().join("jaeger.log");
        let log = std::fs::File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
        let child = Command::new(binary)
            .arg(format!("--config=file:{}", config.display()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(io("duplicating the log file"))?)
            .stderr(log)
            .spawn()
            .map_err(io(format!("starting {}", binary.display())))?;
        let mut jaeger = Self {
            child,
            dir,
            ports,
            started: SystemTime::now(),
        };
        jaeger.wait_ready().await?;
        Ok(jaeger)
    }

    /// Polls the health check (`/status` answers 200 once every pipeline
    /// and extension started) until it passes, Jaeger exits or time is up.
    async fn wait_ready(&mut self) -> Result<(), JaegerError> {
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        let health = SocketAddr::from((Ipv4Addr::LOCALHOST, self.ports.health));
        loop {
            if let Some(status) = self.child.try_wait().map_err(io("checking on Jaeger"))? {
                return Err(JaegerError::NotReady {
                    reason: format!("it exited with {status}"),
                    log: self.log(),
                });
            }
            if let Ok((200, _)) = http_get(health, "/status").await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(JaegerError::NotReady {
                    reason: format!("not healthy within {READY_TIMEOUT:?}"),
                    log: self.log(),
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// Jaeger's own log (stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("jaeger.log")).unwrap_or_default()
    }

    /// `http://127.0.0.1:PORT`: the value for `OTEL_EXPORTER_OTLP_ENDPOINT`
    /// of processes in the host's network namespace.
    pub fn otlp_endpoint(&self) -> String {
        format!("http://{}", self.otlp_addr())
    }

    /// Jaeger's OTLP/gRPC address.
    pub fn otlp_addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.ports.otlp_grpc))
    }

    /// The query API's address (`/api/v3/...`, `/api/traces`).
    pub fn query_addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.ports.query_http))
    }

    /// A relay from `127.0.0.1:<port>` inside `ns` to Jaeger's OTLP port, for
    /// the processes running in that namespace; stops on drop.
    pub fn relay_into(&self, ns: &NetNs) -> Result<OtlpRelay, JaegerError> {
        OtlpRelay::start(ns, self.otlp_addr())
    }

    /// Every span of trace `trace_id` (32 hex digits) Jaeger holds; empty
    /// when it holds none.
    pub async fn trace(&self, trace_id: &str) -> Result<Vec<JaegerSpan>, JaegerError> {
        self.query(&format!("/api/v3/traces/{trace_id}")).await
    }

    /// Every span of every trace holding a span of `service` (whole traces,
    /// the other services' spans included).
    pub async fn traces_of(&self, service: &str) -> Result<Vec<JaegerSpan>, JaegerError> {
        let since = self.started - Duration::from_secs(60);
        let until = SystemTime::now() + Duration::from_secs(60);
        self.query(&service_query_path(service, since, until)).await
    }

    /// Polls [`trace`](Self::trace) until `done` holds for its spans or
    /// `timeout` passes; returns the spans either way (assert on them).
    pub async fn wait_for_trace(
        &self,
        trace_id: &str,
        timeout: Duration,
        done: impl Fn(&[JaegerSpan]) -> bool,
    ) -> Result<Vec<JaegerSpan>, JaegerError> {
        self.poll(timeout, done, || self.trace(trace_id)).await
    }

    /// Polls [`traces_of`](Self::traces_of) until `done` holds or `timeout`
    /// passes; returns the spans either way.
    pub async fn wait_for_service(
        &self,
        service: &str,
        timeout: Duration,
        done: impl Fn(&[JaegerSpan]) -> bool,
    ) -> Result<Vec<JaegerSpan>, JaegerError> {
        self.poll(timeout, done, || self.traces_of(service)).await
    }

    async fn poll<F: Future<Output = Result<Vec<JaegerSpan>, JaegerError>>>(
        &self,
        timeout: Duration,
        done: impl Fn(&[JaegerSpan]) -> bool,
        fetch: impl Fn() -> F,
    ) -> Result<Vec<JaegerSpan>, JaegerError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let spans = fetch().await?;
            if done(&spans) || tokio::time::Instant::now() >= deadline {
                return Ok(spans);
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// One query; "no traces" (404) is an empty list.
    async fn query(&self, path: &str) -> Result<Vec<JaegerSpan>, JaegerError> {
        let failed = |reason: String| JaegerError::Query {
            path: path.to_owned(),
            reason,
        };
        let (status, body) = http_get(self.query_addr(), path)
            .await
            .map_err(|e| failed(e.to_string()))?;
        match status {
            200 => parse_traces(&body).map_err(|e| failed(format!("{e} in {}", String::from_utf8_lossy(&body)))),
            404 => Ok(Vec::new()),
            _ => Err(failed(format!("HTTP {status}: {}", String::from_utf8_lossy(&body)))),
        }
    }
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        // Already gone is fine; the temp dir goes with `self.dir`.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The query API path (`/api/v3/traces?...`) of every trace holding a span
/// of `service` that started between `since` and `until`, for a Jaeger
/// reached another way (a Kubernetes Service proxy); [`parse_traces`]
/// reads the answer.
pub fn service_query_path(service: &str, since: SystemTime, until: SystemTime) -> String {
    format!(
        "/api/v3/traces?query.service_name={}&query.start_time_min={}&query.start_time_max={}&query.num_traces=10000",
        encode(service),
        humantime::format_rfc3339_nanos(since),
        humantime::format_rfc3339_nanos(until),
    )
}

/// The spans of a `/api/v3/traces` answer (OTLP JSON), flattened.
///
/// # Errors
/// The body is not such an answer.
pub fn parse_traces(body: &[u8]) -> Result<Vec<JaegerSpan>, serde_json::Error> {
    let wrapper: otlp_json::Wrapper = serde_json::from_slice(body)?;
    Ok(wrapper.result.spans())
}

/// Percent-encodes a query parameter value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => char::from(b).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A GET over HTTP/1.1; the status and the whole body.
async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, Bytes), Box<dyn std::error::Error + Send + Sync>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let request = http::Request::get(path)
        .header(http::header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())?;
    let exchange = async move {
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, body))
    };
    // The connection ends once the exchange dropped its sender.
    let (result, _) = tokio::join!(exchange, connection);
    result
}

/// One span as Jaeger returns it, flattened for assertions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JaegerSpan {
    /// Resource attribute `service.name` of the exporting process.
    pub service_name: String,
    /// Every resource attribute (`service.instance.id`, `k8s.node.name`, ...).
    pub resource: BTreeMap<String, String>,
    /// Span name.
    pub name: String,
    /// Lowercase hex, 32 digits.
    pub trace_id: String,
    /// Lowercase hex, 16 digits.
    pub span_id: String,
    /// Lowercase hex, 16 digits; empty for a root span.
    pub parent_span_id: String,
    /// OTLP `SpanKind`: 1 internal, 2 server, 3 client, 4 producer, 5 consumer.
    pub kind: i32,
    /// Start, nanoseconds since the Unix epoch.
    pub start_unix_nanos: u64,
    /// End, nanoseconds since the Unix epoch.
    pub end_unix_nanos: u64,
    /// Span attributes, values as text (`42`, `true`, `[a, b]`).
    pub attributes: BTreeMap<String, String>,
    /// Links to spans of other traces.
    pub links: Vec<JaegerLink>,
    /// OTLP status code: 0 unset, 1 ok, 2 error.
    pub status_code: i32,
}

impl JaegerSpan {
    /// The span's duration.
    pub fn duration(&self) -> Duration {
        Duration::from_nanos(self.end_unix_nanos.saturating_sub(self.start_unix_nanos))
    }

    /// Attribute `key`, if set.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// A span link.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JaegerLink {
    /// The linked span's trace.
    pub trace_id: String,
    /// The linked span.
    pub span_id: String,
    /// Link attributes.
    pub attributes: BTreeMap<String, String>,
}

/// The spans of `spans` whose parent is not among them (a broken
/// parent-child link; roots are not orphans).
pub fn orphans(spans: &[JaegerSpan]) -> Vec<&JaegerSpan> {
    let ids: BTreeSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    spans
        .iter()
        .filter(|s| !s.parent_span_id.is_empty() && !ids.contains(s.parent_span_id.as_str()))
        .collect()
}

/// The direct children of `parent` in `spans`.
pub fn children<'a>(spans: &'a [JaegerSpan], parent: &JaegerSpan) -> Vec<&'a JaegerSpan> {
    spans
        .iter()
        .filter(|s| s.trace_id == parent.trace_id && s.parent_span_id == parent.span_id)
        .collect()
}

/// How much of `parent`'s time no direct child covers (children overlapping
/// each other count once).
pub fn uncovered(spans: &[JaegerSpan], parent: &JaegerSpan) -> Duration {
    let mut intervals: Vec<(u64, u64)> = children(spans, parent)
        .iter()
        .map(|c| {
            (
                c.start_unix_nanos.max(parent.start_unix_nanos),
                c.end_unix_nanos.min(parent.end_unix_nanos),
            )
        })
        .filter(|(start, end)| start < end)
        .collect();
    intervals.sort_unstable();
    let mut covered = 0;
    let mut reach = parent.start_unix_nanos;
    for (start, end) in intervals {
        let start = start.max(reach);
        if end > start {
            covered += end - start;
            reach = end;
        }
    }
    Duration::from_nanos(
        parent
            .end_unix_nanos
            .saturating_sub(parent.start_unix_nanos)
            .saturating_sub(covered),
    )
}

/// The OTLP JSON that `/api/v3/traces` answers (`{"result": TracesData}`).
mod otlp_json {
    use super::*;

    #[derive(Deserialize)]
    pub(super) struct Wrapper {
        pub(super) result: TracesData,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub(super) struct TracesData {
        #[serde(default)]
        resource_spans: Vec<ResourceSpans>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ResourceSpans {
        #[serde(default)]
        resource: Resource,
        #[serde(default)]
        scope_spans: Vec<ScopeSpans>,
    }

    #[derive(Deserialize, Default)]
    struct Resource {
        #[serde(default)]
        attributes: Vec<KeyValue>,
    }

    #[derive(Deserialize)]
    struct ScopeSpans {
        #[serde(default)]
        spans: Vec<Span>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Span {
        trace_id: String,
        span_id: String,
        #[serde(default)]
        parent_span_id: String,
        #[serde(default)]
        name: String,
        #[serde(default)]
        kind: serde_json::Value,
        #[serde(default)]
        start_time_unix_nano: serde_json::Value,
        #[serde(default)]
        end_time_unix_nano: serde_json::Value,
        #[serde(default)]
        attributes: Vec<KeyValue>,
        #[serde(default)]
        links: Vec<Link>,
        #[serde(default)]
        status: Status,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Link {
        trace_id: String,
        span_id: String,
        #[serde(default)]
        attributes: Vec<KeyValue>,
    }

    #[derive(Deserialize, Default)]
    struct Status {
        #[serde(default)]
        code: serde_json::Value,
    }

    #[derive(Deserialize)]
    struct KeyValue {
        key: String,
        #[serde(default)]
        value: serde_json::Value,
    }

    impl TracesData {
        pub(super) fn spans(self) -> Vec<JaegerSpan> {
            let mut out = Vec::new();
            for resource_spans in self.resource_spans {
                let resource = map(&resource_spans.resource.attributes);
                let service_name = resource.get("service.name").cloned().unwrap_or_default();
                for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                    out.push(JaegerSpan {
                        service_name: service_name.clone(),
                        resource: resource.clone(),
                        name: span.name,
                        trace_id: span.trace_id.to_ascii_lowercase(),
                        span_id: span.span_id.to_ascii_lowercase(),
                        parent_span_id: span.parent_span_id.to_ascii_lowercase(),
                        kind: enum_number(
                            &span.kind,
                            &["UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER"],
                        ),
                        start_unix_nanos: number(&span.start_time_unix_nano),
                        end_unix_nanos: number(&span.end_time_unix_nano),
                        attributes: map(&span.attributes),
                        links: span
                            .links
                            .iter()
                            .map(|l| JaegerLink {
                                trace_id: l.trace_id.to_ascii_lowercase(),
                                span_id: l.span_id.to_ascii_lowercase(),
                                attributes: map(&l.attributes),
                            })
                            .collect(),
                        status_code: enum_number(&span.status.code, &["UNSET", "OK", "ERROR"]),
                    });
                }
            }
            out
        }
    }

    fn map(attributes: &[KeyValue]) -> BTreeMap<String, String> {
        attributes
            .iter()
            .map(|kv| (kv.key.clone(), render(&kv.value)))
            .collect()
    }

    /// A proto3-JSON 64-bit number: a string or a number.
    fn number(value: &serde_json::Value) -> u64 {
        match value {
            serde_json::Value::String(s) => s.parse().unwrap_or_default(),
            other => other.as_u64().unwrap_or_default(),
        }
    }

    /// A proto3-JSON enum: its number, or its name (with or without the
    /// `SPAN_KIND_` / `STATUS_CODE_` prefix) looked up in `names`.
    fn enum_number(value: &serde_json::Value, names: &[&str]) -> i32 {
        match value {
            serde_json::Value::String(s) => names.iter().position(|n| s.ends_with(n)).map_or(0, |i| i as i32),
            other => other.as_i64().map_or(0, |n| n as i32),
        }
    }

    /// An OTLP `AnyValue` as text: strings as-is, scalars printed, arrays
    /// as `[a, b]`, maps as `{k: v}`.
    fn render(value: &serde_json::Value) -> String {
        use serde_json::Value;
        let Some(object) = value.as_object() else {
            return String::new();
        };
        let Some((kind, inner)) = object.iter().next() else {
            return String::new();
        };
        match (kind.as_str(), inner) {
            (_, Value::String(s)) => s.clone(),
            ("arrayValue", Value::Object(array)) => {
                let items: Vec<String> = array
                    .get("values")
                    .and_then(Value::as_array)
                    .map(|values| values.iter().map(render).collect())
                    .unwrap_or_default();
                format!("[{}]", items.join(", "))
            }
            ("kvlistValue", Value::Object(list)) => {
                let items: Vec<String> = list
                    .get("values")
                    .and_then(Value::as_array)
                    .map(|values| {
                        values
                            .iter()
                            .map(|kv| {
                                let key = kv.get("key").and_then(Value::as_str).unwrap_or_default();
                                format!("{key}: {}", render(kv.get("value").unwrap_or(&Value::Null)))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                format!("{{{}}}", items.join(", "))
            }
            (_, other) => other.to_string(),
        }
    }
}

/// A TCP relay whose listener is inside a network namespace and whose
/// connections go to a host-namespace address (Jaeger's OTLP port): the
/// processes of a node namespace export through it. It runs on its own
/// thread and runtime, so it keeps relaying while the test blocks; dropping
/// it closes the listener and every relayed connection.
#[derive(Debug)]
pub struct OtlpRelay {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OtlpRelay {
    /// Binds `127.0.0.1:0` inside `ns` (on a thread that entered it: a
    /// socket stays in the namespace it was created in) and relays every
    /// connection to `target`, connected from this (host) namespace.
    pub fn start(ns: &NetNs, target: SocketAddr) -> Result<Self, JaegerError> {
        let relay_error = |source| JaegerError::Relay {
            namespace: ns.name().to_owned(),
            source,
        };
        let listener = ns
            .in_ns(|| StdTcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
            .map_err(relay_error)?
            .map_err(io(format!("binding 127.0.0.1:0 in namespace {}", ns.name())))?;
        listener
            .set_nonblocking(true)
            .map_err(io("making the relay listener non-blocking"))?;
        let addr = listener.local_addr().map_err(io("reading the relay's address"))?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io("starting the relay's runtime"))?;
        let thread = std::thread::Builder::new()
            .name("otlp-relay".to_owned())
            .spawn(move || runtime.block_on(relay(listener, target, stop_rx)))
            .map_err(io("spawning the relay thread"))?;
        Ok(Self {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`: `OTEL_EXPORTER_OTLP_ENDPOINT` for processes
    /// inside the namespace.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for OtlpRelay {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Accepts until stopped; each connection is copied both ways to `target`.
/// Stopping drops the set of connection tasks, which aborts them.
async fn relay(listener: StdTcpListener, target: SocketAddr, mut stop: oneshot::Receiver<()>) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => {
                let Ok((mut inbound, _)) = accepted else { continue };
                connections.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(id: &str, parent: &str, start: u64, end: u64) -> JaegerSpan {
        JaegerSpan {
            trace_id: "t".into(),
            span_id: id.into(),
            parent_span_id: parent.into(),
            start_unix_nanos: start,
            end_unix_nanos: end,
            ..JaegerSpan::default()
        }
    }

    #[test]
    fn jaeger_uncovered_counts_overlapping_children_once() {
        let spans = [
            span("p", "", 0, 100),
            span("a", "p", 10, 40),
            span("b", "p", 30, 50),
            span("c", "p", 90, 120),
            span("x", "a", 0, 100),
        ];
        // Covered: 10..50 and 90..100.
        assert_eq!(uncovered(&spans, &spans[0]), Duration::from_nanos(50));
        assert_eq!(children(&spans, &spans[0]).len(), 3);
    }

    #[test]
    fn jaeger_orphans_are_spans_whose_parent_is_missing() {
        let spans = [span("p", "", 0, 1), span("a", "p", 0, 1), span("b", "gone", 0, 1)];
        let found: Vec<&str> = orphans(&spans).iter().map(|s| s.span_id.as_str()).collect();
        assert_eq!(found, ["b"]);
    }

    #[test]
    fn jaeger_parses_the_query_api_answer() {
        let body = r#"{"result":{"resourceSpans":[{"resource":{"attributes":[
            {"key":"service.name","value":{"stringValue":"svc-x"}},
            {"key":"service.instance.id","value":{"stringValue":"b-1"}}]},
          "scopeSpans":[{"scope":{},"spans":[{"traceId":"0102","spanId":"0A0B","parentSpanId":"","name":"n",
            "kind":2,"startTimeUnixNano":"10","endTimeUnixNano":"25",
            "attributes":[{"key":"n","value":{"intValue":"42"}},
              {"key":"l","value":{"arrayValue":{"values":[{"stringValue":"a"},{"stringValue":"b"}]}}}],
            "links":[{"traceId":"ff","spanId":"ee"}],"status":{"code":2}}]}]}]}}"#;
        let wrapper: otlp_json::Wrapper = serde_json::from_str(body).unwrap();
        let spans = wrapper.result.spans();
        assert_eq!(spans.len(), 1);
        let s = &spans[0];
        assert_eq!(s.service_name, "svc-x");
        assert_eq!(s.resource["service.instance.id"], "b-1");
        assert_eq!((s.span_id.as_str(), s.kind, s.status_code), ("0a0b", 2, 2));
        assert_eq!(s.duration(), Duration::from_nanos(15));
        assert_eq!(s.attribute("n"), Some("42"));
        assert_eq!(s.attribute("l"), Some("[a, b]"));
        assert_eq!(s.links[0].trace_id, "ff");
    }

    #[test]
    fn jaeger_query_values_are_percent_encoded() {
        assert_eq!(encode("svc-ipam"), "svc-ipam");
        assert_eq!(encode("a b&c"), "a%20b%26c");
    }
}
