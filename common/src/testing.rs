//! Test support (cargo feature `testing`): an in-process OTLP trace collector
//! and real daemon processes under test ([`DaemonCommand`], [`DaemonProcess`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use rivet_common::testing::OtlpCollector;
//!
//! # async fn t() -> std::io::Result<()> {
//! let collector = OtlpCollector::start().await?;
//! // Point the process (or a child process) under test at it:
//! // OTEL_EXPORTER_OTLP_ENDPOINT=<collector.endpoint()>
//! let spans = collector
//!     .wait_for(Duration::from_secs(10), |spans| spans.iter().any(|s| s.name == "allocate"))
//!     .await;
//! assert!(spans.iter().any(|s| s.name == "allocate"), "{spans:#?}");
//! # Ok(()) }
//! ```

pub mod etcd;
pub mod netns;
pub mod peer;
mod process;
pub use process::{DaemonCommand, DaemonProcess};

/// A log file's text (lossy UTF-8) for an error message, or a note saying
/// why it cannot be read.
pub fn read_log(path: &std::path::Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(err) => format!("<cannot read {}: {err}>", path.display()),
    }
}

/// The last `n` lines of `text` (a log's tail for an error message).
///
/// ```
/// assert_eq!(rivet_common::testing::last_lines("a\nb\nc\n", 2), "b\nc");
/// ```
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A binary of this workspace built beside the running test
/// (`target/<profile>/deps/<test>` → `target/<profile>/<name>`). Panics with
/// how to build it when missing: `cargo test --workspace` builds every
/// binary, `cargo test -p <crate>` only that crate's.
pub fn workspace_binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let bin = exe
        .parent()
        .and_then(std::path::Path::parent)
        .map(|dir| dir.join(name))
        .expect("the test binary lives in target/<profile>/deps");
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build --bins` (cargo test --workspace builds it)",
        bin.display()
    );
    bin
}

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use tokio::sync::oneshot;

/// How often [`OtlpCollector::wait_for`] looks at the received spans.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// One span as received by [`OtlpCollector`], flattened for assertions.
///
/// ```
/// use rivet_common::testing::CollectedSpan;
///
/// fn server_spans(spans: &[CollectedSpan]) -> impl Iterator<Item = &CollectedSpan> {
///     spans.iter().filter(|s| s.kind == 2) // SPAN_KIND_SERVER
/// }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CollectedSpan {
    /// Resource attribute `service.name` of the exporting process.
    pub service_name: String,
    /// Span name (`otel.name` when set on a tracing span).
    pub name: String,
    /// Lowercase hex, 32 characters.
    pub trace_id: String,
    /// Lowercase hex, 16 characters.
    pub span_id: String,
    /// Lowercase hex, 16 characters; empty for a root span.
    pub parent_span_id: String,
    /// OTLP `SpanKind`: 1 internal, 2 server, 3 client, 4 producer, 5 consumer.
    pub kind: i32,
    /// Span attributes, values rendered as text (`42`, `true`, `GetInfo`).
    pub attributes: BTreeMap<String, String>,
}

/// A small in-process OTLP trace collector: a tonic server implementing
/// OTLP's `TraceService` on `127.0.0.1:<free port>`.
///
/// It runs on its own thread and runtime, so it keeps receiving while the test
/// blocks (e.g. in [`TelemetryGuard`](crate::telemetry::TelemetryGuard)'s
/// flush on drop) whatever the test's runtime flavor. The server is aborted
/// when the collector is dropped.
///
/// ```no_run
/// # async fn t() -> std::io::Result<()> {
/// let collector = rivet_common::testing::OtlpCollector::start().await?;
/// let mut child = std::process::Command::new("svc-ipam")
///     .env("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint())
///     .spawn()?;
/// # child.kill()?; Ok(()) }
/// ```
pub struct OtlpCollector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<CollectedSpan>>>,
    /// Dropping (or sending on) it makes the collector thread abort the server.
    stop: Option<oneshot::Sender<()>>,
}

impl std::fmt::Debug for OtlpCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpCollector")
            .field("addr", &self.addr)
            .field("spans", &lock(&self.spans).len())
            .finish()
    }
}

impl OtlpCollector {
    /// Binds `127.0.0.1:0` and starts serving.
    ///
    /// ```no_run
    /// # async fn t() -> std::io::Result<()> {
    /// let collector = rivet_common::testing::OtlpCollector::start().await?;
    /// assert!(collector.endpoint().starts_with("http://127.0.0.1:"));
    /// # Ok(()) }
    /// ```
    pub async fn start() -> std::io::Result<Self> {
        Self::start_on(std::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?).await
    }

    /// Serves on a listener bound elsewhere, e.g. inside a network namespace
    /// (bound with [`netns::NetNs::in_ns`]) for daemons running there.
    ///
    /// ```no_run
    /// # async fn t() -> std::io::Result<()> {
    /// let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    /// let collector = rivet_common::testing::OtlpCollector::start_on(listener).await?;
    /// # Ok(()) }
    /// ```
    pub async fn start_on(listener: std::net::TcpListener) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let spans = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = oneshot::channel::<std::io::Result<SocketAddr>>();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let sink = Sink {
            spans: Arc::clone(&spans),
        };
        std::thread::Builder::new()
            .name("otlp-collector".to_owned())
            .spawn(move || run(sink, listener, ready_tx, stop_rx))?;
        ready_rx
            .await
            .map_err(|_| std::io::Error::other("the OTLP collector thread exited before it was ready"))??;
        Ok(Self {
            addr,
            spans,
            stop: Some(stop_tx),
        })
    }

    /// `http://127.0.0.1:PORT`, the value for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    ///
    /// ```no_run
    /// # fn f(collector: &rivet_common::testing::OtlpCollector) {
    /// let mut cmd = std::process::Command::new("svc-ipam");
    /// cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint());
    /// # }
    /// ```
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far, in arrival order.
    ///
    /// ```no_run
    /// # fn f(collector: &rivet_common::testing::OtlpCollector) {
    /// let names: Vec<String> = collector.spans().into_iter().map(|s| s.name).collect();
    /// # }
    /// ```
    pub fn spans(&self) -> Vec<CollectedSpan> {
        lock(&self.spans).clone()
    }

    /// Polls until `pred` holds for the received spans or `timeout` passes,
    /// and returns the spans either way (assert on them afterwards).
    ///
    /// ```no_run
    /// # async fn f(collector: &rivet_common::testing::OtlpCollector) {
    /// use std::time::Duration;
    /// let spans = collector
    ///     .wait_for(Duration::from_secs(5), |spans| spans.len() >= 2)
    ///     .await;
    /// assert!(spans.len() >= 2, "expected two spans, got {spans:#?}");
    /// # }
    /// ```
    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&[CollectedSpan]) -> bool) -> Vec<CollectedSpan> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if pred(&spans) || tokio::time::Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

impl Drop for OtlpCollector {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            // The thread may already be gone; nothing else to do then.
            let _ = stop.send(());
        }
    }
}

/// Body of the collector thread: serve until told to stop (or the collector
/// is dropped), then abort the server and drop the runtime.
fn run(
    sink: Sink,
    listener: std::net::TcpListener,
    ready: oneshot::Sender<std::io::Result<SocketAddr>>,
    stop: oneshot::Receiver<()>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            let _ = ready.send(Err(err));
            return;
        }
    };
    runtime.block_on(async move {
        let bound =
            tokio::net::TcpListener::from_std(listener).and_then(|listener| Ok((listener.local_addr()?, listener)));
        let listener = match bound {
            Ok((addr, listener)) => {
                if ready.send(Ok(addr)).is_err() {
                    return; // start() was cancelled.
                }
                listener
            }
            Err(err) => {
                let _ = ready.send(Err(err));
                return;
            }
        };
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(sink))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        // Err means the collector was dropped without sending: stop as well.
        let _ = stop.await;
        server.abort();
        let _ = server.await;
    });
}

/// The `TraceService` implementation: flattens and stores every span.
struct Sink {
    spans: Arc<Mutex<Vec<CollectedSpan>>>,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let request = request.into_inner();
        let mut collected = Vec::new();
        for resource_spans in request.resource_spans {
            let service_name = resource_spans
                .resource
                .as_ref()
                .and_then(|resource| find(&resource.attributes, "service.name"))
                .unwrap_or_default();
            for scope_spans in resource_spans.scope_spans {
                for span in scope_spans.spans {
                    collected.push(CollectedSpan {
                        service_name: service_name.clone(),
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        kind: span.kind,
                        attributes: span
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), render(kv.value.as_ref())))
                            .collect(),
                    });
                }
            }
        }
        lock(&self.spans).extend(collected);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Locks, ignoring poisoning (a panicking test must not hide its spans).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn find(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| render(kv.value.as_ref()))
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

/// Renders an attribute value as text: strings as-is, scalars with
/// `to_string`, bytes as hex, arrays as `[a, b]`, maps as `{k: v}`.
fn render(value: Option<&AnyValue>) -> String {
    use any_value::Value;
    match value.and_then(|v| v.value.as_ref()) {
        None => String::new(),
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BytesValue(bytes)) => hex(bytes),
        Some(Value::ArrayValue(array)) => {
            let items: Vec<String> = array.values.iter().map(|v| render(Some(v))).collect();
            format!("[{}]", items.join(", "))
        }
        Some(Value::KvlistValue(list)) => {
            let items: Vec<String> = list
                .values
                .iter()
                .map(|kv| format!("{}: {}", kv.key, render(kv.value.as_ref())))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Some(Value::StringValueStrindex(index)) => format!("<string table #{index}>"),
    }
}

/// A plain HTTP/1.1 GET to `addr` (a daemon's `/metrics` or `/healthz`);
/// returns the raw response, status line first.
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: rivet\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    stream.read_to_string(&mut out).await?;
    Ok(out)
}

/// The value of one sample of a `/metrics` text, the series named exactly
/// as printed (`rivet_x_total{kind="a"}`); `None` when it is not there.
///
/// ```
/// let text = "# TYPE rivet_x counter\nrivet_x_total{kind=\"a\"} 3\n";
/// assert_eq!(rivet_common::testing::metric_sample(text, "rivet_x_total{kind=\"a\"}"), Some(3.0));
/// assert_eq!(rivet_common::testing::metric_sample(text, "rivet_x_total"), None);
/// ```
pub fn metric_sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .split(' ')
            .next()?
            .parse()
            .ok()
    })
}

/// A TCP port on 127.0.0.1 that was free a moment ago (for a daemon's
/// `--metrics-address`).
pub fn free_local_port() -> u16 {
    std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 to find a free port")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn testing_hex_is_lowercase() {
        assert_eq!(hex(&[0x00, 0xab, 0x0f]), "00ab0f");
        assert_eq!(hex(&[]), "");
    }

    #[test]
    fn testing_render_values() {
        let int = AnyValue {
            value: Some(any_value::Value::IntValue(13)),
        };
        assert_eq!(render(Some(&int)), "13");
        assert_eq!(render(None), "");
    }
}
