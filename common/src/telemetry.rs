//! Logs and distributed traces of every Rivet process (DESIGN.md §7).
//!
//! * [`init`] installs the global `tracing` subscriber: human or JSON logs on
//!   stderr, filtered by `RUST_LOG`, and — when `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   is set — every span exported over OTLP/gRPC. It returns a
//!   [`TelemetryGuard`] that flushes the exporter when dropped.
//! * Trace context crosses process boundaries in gRPC metadata as a W3C
//!   `traceparent` header: [`TraceContextClientLayer`] injects it into every
//!   outgoing request, [`TraceContextServerLayer`] extracts it and opens a
//!   `grpc.server` span that continues the caller's trace. One pod creation is
//!   therefore one trace across rivet-cni and every daemon it calls.
//!
//! ```no_run
//! use rivet_common::telemetry::{self, LogFormat, TelemetryOptions};
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let _telemetry = telemetry::init(TelemetryOptions {
//!         service_name: "svc-ipam".into(),
//!         log_format: LogFormat::Text,
//!         default_filter: "info".into(),
//!         resource_attributes: Vec::new(),
//!     })?;
//!     tracing::info!("started");
//!     Ok(()) // `_telemetry` is dropped here and flushes every pending span.
//! }
//! ```

use std::fmt;
use std::io::IsTerminal as _;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tower::{Layer, Service};
use tracing::Instrument as _;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer as _, Registry};

/// The environment variable that turns OTLP span export on.
const OTLP_ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The environment variable holding the log filter directives.
const FILTER_VAR: &str = "RUST_LOG";
/// Upper bound for flushing the span exporter at shutdown; a collector that is
/// down must not hold up process exit for longer than this.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// How log lines are written to stderr.
///
/// ```
/// use clap::ValueEnum as _;
/// use rivet_common::telemetry::LogFormat;
///
/// assert_eq!(LogFormat::from_str("json", true), Ok(LogFormat::Json));
/// assert_eq!(LogFormat::Text.to_string(), "text");
/// ```
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LogFormat {
    /// Human-readable lines (colored when stderr is a terminal).
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// What [`init`] needs to know about the process.
///
/// ```
/// use rivet_common::telemetry::{LogFormat, TelemetryOptions};
///
/// let opts = TelemetryOptions {
///     service_name: "svc-ipam".into(),
///     log_format: LogFormat::Json,
///     default_filter: "info,rivet=debug".into(),
///     resource_attributes: vec![("service.instance.id".into(), "5f0c...".into())],
/// };
/// assert_eq!(TelemetryOptions::new("svc-ipam").default_filter, "info");
/// # drop(opts);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TelemetryOptions {
    /// OTLP resource attribute `service.name`, e.g. `"svc-ipam"`.
    pub service_name: String,
    /// Log line format on stderr.
    pub log_format: LogFormat,
    /// `EnvFilter` directives used when `RUST_LOG` is unset or empty, e.g. `"info"`.
    pub default_filter: String,
    /// Further OTLP resource attributes of the process (OpenTelemetry
    /// semantic conventions), e.g. `service.instance.id` = the boot id and
    /// `k8s.node.name`.
    pub resource_attributes: Vec<(String, String)>,
}

impl TelemetryOptions {
    /// Text logs at `info` for `service_name`.
    ///
    /// ```
    /// let opts = rivet_common::telemetry::TelemetryOptions::new("rivet-cni");
    /// assert_eq!(opts.service_name, "rivet-cni");
    /// ```
    pub fn new(service_name: impl Into<String>) -> Self {
        Self {
            service_name: service_name.into(),
            log_format: LogFormat::Text,
            default_filter: "info".to_owned(),
            resource_attributes: Vec::new(),
        }
    }
}

/// Why telemetry could not be set up or shut down.
///
/// ```
/// use rivet_common::telemetry::TelemetryError;
///
/// fn report(err: &TelemetryError) -> String {
///     // Every variant names what was being done; the cause is in `source()`.
///     format!("{err}: {:?}", std::error::Error::source(err).map(|s| s.to_string()))
/// }
/// ```
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum TelemetryError {
    /// `RUST_LOG` is set but is not a valid filter.
    #[error("parsing the log filter {value:?} from RUST_LOG")]
    InvalidEnvFilter {
        /// The offending value.
        value: String,
        /// What is wrong with it.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// `RUST_LOG` is set but is not valid UTF-8.
    #[error("reading RUST_LOG (its value is not valid UTF-8)")]
    EnvFilterNotUnicode,
    /// The built-in default filter is not valid.
    #[error("parsing the default log filter {value:?}")]
    InvalidDefaultFilter {
        /// The offending value.
        value: String,
        /// What is wrong with it.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// The small tokio runtime that drives the OTLP exporter could not start.
    #[error("starting the OTLP export runtime thread")]
    ExportRuntime(#[source] std::io::Error),
    /// The OTLP span exporter rejected its configuration (endpoint, headers, ...).
    #[error("building the OTLP/gRPC span exporter for {endpoint:?}")]
    Exporter {
        /// The endpoint: `OTEL_EXPORTER_OTLP_ENDPOINT`, or the one given.
        endpoint: String,
        /// What the exporter complained about.
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// A global tracing subscriber (or `log` logger) was already installed.
    #[error("installing the global tracing subscriber (was telemetry::init called twice?)")]
    SetSubscriber(#[source] tracing_subscriber::util::TryInitError),
    /// Flushing pending spans or shutting the exporter down failed or timed out.
    #[error("flushing and shutting down the OTLP tracer provider")]
    Shutdown(#[source] opentelemetry_sdk::error::OTelSdkError),
}

/// Keeps the OTLP exporter alive; dropping it (or calling
/// [`shutdown`](Self::shutdown)) exports every span still queued and shuts the
/// tracer provider down, so that no span is lost at exit.
///
/// Hold it in `main` for the lifetime of the process. Without an OTLP endpoint
/// it holds nothing and dropping it is free.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let guard = rivet_common::telemetry::init(
///     rivet_common::telemetry::TelemetryOptions::new("svc-ipam"),
/// )?;
/// // ... serve until SIGTERM ...
/// guard.shutdown()?; // or just let it drop
/// # Ok(()) }
/// ```
#[must_use = "dropping the guard shuts the span exporter down"]
pub struct TelemetryGuard {
    export: Option<OtlpExporter>,
}

/// OTLP/gRPC span export: the tracer provider and the runtime its channel
/// runs on. [`init`] uses it for the daemons; a process with its own log
/// setup (rivet-cni logs to a file) adds [`layer`](Self::layer) to its
/// subscriber and calls [`shutdown`](Self::shutdown) before it exits.
pub struct OtlpExporter {
    provider: SdkTracerProvider,
    service_name: String,
    /// Runs the tonic channel of the exporter. It is separate from the
    /// caller's runtime so that the blocking flush in [`TelemetryGuard`]'s drop
    /// cannot deadlock a current-thread runtime (the exporter's I/O would
    /// otherwise need the very thread that is blocked waiting for it).
    runtime: tokio::runtime::Runtime,
}

impl fmt::Debug for OtlpExporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OtlpExporter")
            .field("service_name", &self.service_name)
            .finish_non_exhaustive()
    }
}

impl OtlpExporter {
    /// The exporter configured by the standard `OTEL_EXPORTER_OTLP_*`
    /// variables, or `None` when `OTEL_EXPORTER_OTLP_ENDPOINT` is unset or
    /// empty (export off). Its resource is `service.name = service_name`
    /// plus `resource_attributes`.
    ///
    /// ```no_run
    /// # fn f() -> Result<(), rivet_common::telemetry::TelemetryError> {
    /// let instance = [("service.instance.id".to_owned(), "5f0c...".to_owned())];
    /// let exporter = rivet_common::telemetry::OtlpExporter::from_env("rivet-cni", &instance)?;
    /// assert!(exporter.is_none() || std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").is_ok());
    /// # Ok(()) }
    /// ```
    pub fn from_env(
        service_name: &str,
        resource_attributes: &[(String, String)],
    ) -> Result<Option<Self>, TelemetryError> {
        match std::env::var(OTLP_ENDPOINT_VAR) {
            Ok(endpoint) if !endpoint.trim().is_empty() => {
                otlp_export(service_name, resource_attributes, endpoint, false).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The exporter sending to `endpoint` (`http://host:4317`), which wins
    /// over the `OTEL_EXPORTER_OTLP_*ENDPOINT` variables (the other
    /// `OTEL_EXPORTER_OTLP_*` settings still apply): rivet-cni's netconf
    /// names its collector.
    ///
    /// ```no_run
    /// # fn f() -> Result<(), rivet_common::telemetry::TelemetryError> {
    /// let exporter = rivet_common::telemetry::OtlpExporter::to_endpoint("rivet-cni", &[], "http://198.19.255.10:4317")?;
    /// # Ok(()) }
    /// ```
    pub fn to_endpoint(
        service_name: &str,
        resource_attributes: &[(String, String)],
        endpoint: &str,
    ) -> Result<Self, TelemetryError> {
        otlp_export(service_name, resource_attributes, endpoint.to_owned(), true)
    }

    /// The subscriber layer exporting spans, without the export machinery's
    /// own spans (h2, hyper, tonic, tower, opentelemetry).
    pub fn layer<S>(&self) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer(self.service_name.clone()))
            .with_filter(filter_fn(|meta| !is_export_machinery(meta.target())))
            .boxed()
    }

    /// Makes this the global tracer provider (after the subscriber is set).
    pub fn install_global(&self) {
        opentelemetry::global::set_tracer_provider(self.provider.clone());
    }

    /// Exports every queued span, waiting at most `timeout`, and stops the
    /// export runtime.
    pub fn shutdown(self, timeout: Duration) -> Result<(), TelemetryError> {
        // The batch processor flushes on shutdown.
        let result = self
            .provider
            .shutdown_with_timeout(timeout)
            .map_err(TelemetryError::Shutdown);
        // Dropping a runtime blocks and panics inside async code; this does not.
        self.runtime.shutdown_background();
        result
    }
}

impl TelemetryGuard {
    /// Flushes pending spans and shuts the exporter down, reporting failure
    /// (e.g. the collector did not answer in time). Dropping the guard does
    /// the same but can only log the failure.
    ///
    /// ```no_run
    /// # fn f(guard: rivet_common::telemetry::TelemetryGuard) {
    /// if let Err(err) = guard.shutdown() {
    ///     eprintln!("some spans were lost: {err}");
    /// }
    /// # }
    /// ```
    pub fn shutdown(mut self) -> Result<(), TelemetryError> {
        match self.export.take() {
            Some(export) => export.shutdown(SHUTDOWN_TIMEOUT),
            None => Ok(()),
        }
    }

    /// Whether spans are being exported over OTLP (i.e. `OTEL_EXPORTER_OTLP_ENDPOINT` was set).
    ///
    /// ```no_run
    /// # fn f(guard: &rivet_common::telemetry::TelemetryGuard) {
    /// tracing::info!(otlp = guard.is_exporting(), "telemetry ready");
    /// # }
    /// ```
    pub fn is_exporting(&self) -> bool {
        self.export.is_some()
    }
}

impl fmt::Debug for TelemetryGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TelemetryGuard")
            .field("exporting", &self.is_exporting())
            .finish()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(export) = self.export.take()
            && let Err(err) = export.shutdown(SHUTDOWN_TIMEOUT)
        {
            let source = std::error::Error::source(&err).map(ToString::to_string);
            tracing::warn!(error = %err, source, "spans may have been lost at exit");
        }
    }
}

/// Installs the global tracing subscriber and, if configured, OTLP export.
///
/// * Logs go to **stderr**, as text or JSON ([`LogFormat`]), filtered by
///   `RUST_LOG` or, when it is unset or empty, by `opts.default_filter`.
/// * Only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set and non-empty, spans are
///   also exported over OTLP/gRPC (tonic) through a batch processor, with the
///   resource attribute `service.name = opts.service_name`. The other standard
///   `OTEL_EXPORTER_OTLP_*` / `OTEL_BSP_*` variables are honoured by the SDK.
///   Spans of the export machinery itself (h2, hyper, tonic, tower,
///   opentelemetry) are never exported, so `RUST_LOG=trace` cannot make the
///   exporter trace itself in a loop.
/// * The global text map propagator is always set to W3C TraceContext.
///
/// Intended to be called once, early in `main`, inside the tokio runtime.
/// (The exporter actually runs on its own one-thread runtime, so calling it
/// outside a runtime works too.) A second call fails with
/// [`TelemetryError::SetSubscriber`].
///
/// ```no_run
/// use rivet_common::telemetry::{init, LogFormat, TelemetryOptions};
///
/// # async fn run() -> Result<(), rivet_common::telemetry::TelemetryError> {
/// let guard = init(TelemetryOptions {
///     service_name: "svc-ipam".into(),
///     log_format: LogFormat::Json,
///     default_filter: "info".into(),
///     resource_attributes: vec![("service.instance.id".into(), "5f0c...".into())],
/// })?;
/// # drop(guard); Ok(()) }
/// ```
pub fn init(opts: TelemetryOptions) -> Result<TelemetryGuard, TelemetryError> {
    install_propagator();
    let env_filter = env_filter(&opts.default_filter)?;

    let export = OtlpExporter::from_env(&opts.service_name, &opts.resource_attributes)?;

    let fmt_layer = match opts.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let mut layers = vec![fmt_layer];
    if let Some(export) = &export {
        layers.push(export.layer());
    }

    if let Err(err) = Registry::default().with(layers).with(env_filter).try_init() {
        if let Some(export) = export {
            // Nothing was exported yet; just stop the threads we started.
            let _ = export.shutdown(SHUTDOWN_TIMEOUT);
        }
        return Err(TelemetryError::SetSubscriber(err));
    }
    if let Some(export) = &export {
        export.install_global();
    }
    Ok(TelemetryGuard { export })
}

/// Sets the global propagator (W3C TraceContext) used by [`inject_context`]
/// and [`extract_context`]; [`init`] does it for the daemons.
pub fn install_propagator() {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
}

/// `RUST_LOG` if set and non-empty, else `default_filter`.
fn env_filter(default_filter: &str) -> Result<EnvFilter, TelemetryError> {
    let builder = EnvFilter::builder();
    match std::env::var(FILTER_VAR) {
        Ok(value) if !value.trim().is_empty() => builder
            .parse(&value)
            .map_err(|source| TelemetryError::InvalidEnvFilter { value, source }),
        Err(std::env::VarError::NotUnicode(_)) => Err(TelemetryError::EnvFilterNotUnicode),
        _ => builder
            .parse(default_filter)
            .map_err(|source| TelemetryError::InvalidDefaultFilter {
                value: default_filter.to_owned(),
                source,
            }),
    }
}

/// Builds the OTLP/gRPC exporter on its own runtime and the tracer provider;
/// `explicit`: `endpoint` is given to the builder rather than left to the
/// variables.
fn otlp_export(
    service_name: &str,
    resource_attributes: &[(String, String)],
    endpoint: String,
    explicit: bool,
) -> Result<OtlpExporter, TelemetryError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rivet-otlp-export")
        .enable_all()
        .build()
        .map_err(TelemetryError::ExportRuntime)?;
    // The tonic channel spawns its connection worker on the runtime that is
    // current while it is built; make that ours.
    let exporter = {
        let _entered = runtime.enter();
        // The endpoint itself is read by the builder from the standard
        // variables (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT wins over ours).
        let builder = opentelemetry_otlp::SpanExporter::builder().with_tonic();
        if explicit {
            builder.with_endpoint(endpoint.clone()).build()
        } else {
            builder.build()
        }
    };
    let exporter = match exporter {
        Ok(exporter) => exporter,
        Err(source) => {
            runtime.shutdown_background();
            return Err(TelemetryError::Exporter { endpoint, source });
        }
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service_name.to_owned())
        .with_attributes(
            resource_attributes
                .iter()
                .map(|(key, value)| opentelemetry::KeyValue::new(key.clone(), value.clone())),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_batch_exporter(exporter)
        .build();
    Ok(OtlpExporter {
        provider,
        service_name: service_name.to_owned(),
        runtime,
    })
}

/// Targets whose spans must not be exported: the exporter's own transport.
fn is_export_machinery(target: &str) -> bool {
    const CRATES: &[&str] = &[
        "h2",
        "hyper",
        "hyper_util",
        "tonic",
        "tower",
        "opentelemetry",
        "opentelemetry_sdk",
        "opentelemetry_otlp",
    ];
    let krate = target.split("::").next().unwrap_or(target);
    CRATES.contains(&krate)
}

/// Writes propagation fields into an [`http::HeaderMap`].
struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // Propagators only produce valid header names and values; anything
        // else is dropped rather than corrupting the request.
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(key.as_bytes()), HeaderValue::from_str(&value)) {
            self.0.insert(name, value);
        }
    }
}

/// Reads propagation fields from an [`http::HeaderMap`].
struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Writes the current span's trace context into `headers` as W3C
/// `traceparent` (and `tracestate` when non-empty), using the global
/// propagator installed by [`init`].
///
/// "Current" is the current `tracing` span's OpenTelemetry context, falling
/// back to [`opentelemetry::Context::current`]. Nothing is written when there
/// is no valid span context (e.g. OTLP export is off), and existing headers
/// are then left untouched.
///
/// ```no_run
/// let span = tracing::info_span!("allocate");
/// let _entered = span.enter();
/// let mut headers = http::HeaderMap::new();
/// rivet_common::telemetry::inject_context(&mut headers);
/// // With OTLP export on, `headers["traceparent"]` is now "00-<trace id>-<span id>-01".
/// ```
pub fn inject_context(headers: &mut HeaderMap) {
    let mut cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        cx = Context::current();
    }
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&cx, &mut HeaderInjector(headers));
    });
}

/// Reads a W3C trace context from `headers` with the global propagator.
///
/// The returned context holds the remote parent span (check
/// `cx.span().span_context().is_valid()`); make it the parent of a local span
/// with [`tracing_opentelemetry::OpenTelemetrySpanExt::set_parent`].
///
/// ```
/// use opentelemetry::trace::TraceContextExt as _;
///
/// let headers = http::HeaderMap::new();
/// let cx = rivet_common::telemetry::extract_context(&headers);
/// assert!(!cx.span().span_context().is_valid()); // no traceparent, no parent
/// ```
pub fn extract_context(headers: &HeaderMap) -> Context {
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&HeaderExtractor(headers)))
}

/// The current span's context as a W3C `traceparent` value (see
/// [`inject_context`]); empty when there is none (e.g. OTLP export is off).
/// For trace context carried in data rather than in request headers (an
/// object followed through a pipeline, as svc-endpoint's watch items).
pub fn current_traceparent() -> String {
    let mut headers = HeaderMap::new();
    inject_context(&mut headers);
    headers
        .get(TRACEPARENT)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// Makes the span context of `traceparent` (a W3C value from
/// [`current_traceparent`]) the parent of `span`, which must not have been
/// entered yet. Returns `false`, leaving `span` without a remote parent, when
/// `traceparent` is empty or not a valid context.
///
/// ```
/// let span = tracing::info_span!("apply");
/// assert!(!rivet_common::telemetry::set_parent_from_traceparent(&span, "not a traceparent"));
/// ```
pub fn set_parent_from_traceparent(span: &tracing::Span, traceparent: &str) -> bool {
    let Ok(value) = HeaderValue::from_str(traceparent) else {
        return false;
    };
    let mut headers = HeaderMap::new();
    headers.insert(TRACEPARENT, value);
    let parent = extract_context(&headers);
    if !parent.span().span_context().is_valid() {
        return false;
    }
    let _ = span.set_parent(parent);
    true
}

/// The W3C header (and field) holding a span context.
const TRACEPARENT: &str = "traceparent";

/// The trace context of one span, kept so that work it causes later, in
/// another task and possibly batched with other causes, links back to it.
/// A span link (not a parent) fits such work: it outlives the cause and may
/// serve several (svc-identity's ipcache push to svc-loader links to the
/// `UpsertIp` requests whose changes it carries).
///
/// ```
/// use rivet_common::telemetry::TraceLink;
///
/// // Without an OpenTelemetry layer (export off) there is nothing to link.
/// let span = tracing::info_span!("ipcache.upsert");
/// assert_eq!(span.in_scope(TraceLink::current), None);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TraceLink(opentelemetry::trace::SpanContext);

impl TraceLink {
    /// The current `tracing` span's context; `None` when export is off or
    /// no traced span is current.
    pub fn current() -> Option<Self> {
        let span_context = tracing::Span::current().context().span().span_context().clone();
        span_context.is_valid().then_some(Self(span_context))
    }

    /// Adds a link from `span` to this context. Links are part of a span's
    /// start: add them before the span is first entered.
    pub fn link_from(&self, span: &tracing::Span) {
        span.add_link(self.0.clone());
    }

    /// The linked span's trace id, 32 lowercase hex digits.
    pub fn trace_id(&self) -> String {
        self.0.trace_id().to_string()
    }
}

/// Splits a gRPC request path `/pkg.Service/Method` into `("pkg.Service", "Method")`.
fn split_grpc_path(path: &str) -> (&str, &str) {
    path.strip_prefix('/')
        .and_then(|rest| rest.split_once('/'))
        .unwrap_or((path, ""))
}

/// Methods that clients poll (daemon liveness and boot ids): traced only
/// inside a caller's trace, never as a trace of their own.
const HEALTH_POLLS: &[&str] = &[
    "/rivet.daemon.v1.Daemon/GetInfo",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
];

/// Whether `path` is one of the [`HEALTH_POLLS`].
fn is_health_poll(path: &str) -> bool {
    HEALTH_POLLS.contains(&path)
}

/// Whether a gRPC status code marks a server span as failed (OTel semantic
/// conventions for gRPC servers: UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED,
/// INTERNAL, UNAVAILABLE, DATA_LOSS).
fn is_server_error(code: i64) -> bool {
    matches!(code, 2 | 4 | 12 | 13 | 14 | 15)
}

/// Tower layer for a tonic **server** that continues the caller's trace.
///
/// For each request it opens
/// `info_span!("grpc.server", otel.name = "pkg.Service/Method", otel.kind = "server",
/// rpc.system = "grpc", rpc.service = "pkg.Service", rpc.method = "Method",
/// rpc.grpc.status_code = <recorded>)`, whose parent is the context extracted
/// from the request's `traceparent` header (if any), and runs the handler in
/// it. The status code comes from the response's `grpc-status` header (how
/// tonic reports a handler's `Err(Status)`), else 0. Error codes also set
/// `otel.status_code = "ERROR"`.
///
/// The span covers the handler up to the response headers; the body of a
/// streaming response is sent after the span has closed.
///
/// Health polls (`rivet.daemon.v1.Daemon/GetInfo`, gRPC health checks)
/// without an incoming trace context get no span: they would otherwise be a
/// root trace each, most of all traces. With a caller's context (rivet-cni
/// asks svc-endpoint whether it is up inside `cni.add`) they are traced.
///
/// ```no_run
/// use rivet_common::telemetry::TraceContextServerLayer;
/// use rivet_proto::daemon::v1::daemon_server::{Daemon, DaemonServer};
///
/// # async fn serve(svc: impl Daemon, listener: tokio::net::UnixListener) -> Result<(), tonic::transport::Error> {
/// tonic::transport::Server::builder()
///     .layer(TraceContextServerLayer::default())
///     .add_service(DaemonServer::new(svc))
///     .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
///     .await
/// # }
/// ```
///
/// Construct it with `TraceContextServerLayer::default()` (the type is `#[non_exhaustive]`
/// so that options can be added later).
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct TraceContextServerLayer;

impl<S> Layer<S> for TraceContextServerLayer {
    type Service = TraceContextServer<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceContextServer::new(inner)
    }
}

/// The service made by [`TraceContextServerLayer`].
///
/// ```
/// use rivet_common::telemetry::TraceContextServer;
///
/// let svc = TraceContextServer::new(tower::service_fn(|_req: http::Request<()>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(()))
/// }));
/// # drop(svc);
/// ```
#[derive(Clone, Debug)]
pub struct TraceContextServer<S> {
    inner: S,
}

impl<S> TraceContextServer<S> {
    /// Wraps `inner`.
    ///
    /// ```
    /// # let inner = tower::service_fn(|_req: http::Request<()>| async {
    /// #     Ok::<_, std::convert::Infallible>(http::Response::new(()))
    /// # });
    /// let svc = rivet_common::telemetry::TraceContextServer::new(inner);
    /// # drop(svc);
    /// ```
    pub fn new(inner: S) -> Self {
        Self { inner }
    }

    /// Unwraps the inner service.
    ///
    /// ```
    /// let svc = rivet_common::telemetry::TraceContextServer::new(42);
    /// assert_eq!(svc.into_inner(), 42);
    /// ```
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for TraceContextServer<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let parent = extract_context(req.headers());
        let continues_a_trace = parent.span().span_context().is_valid();
        if !continues_a_trace && is_health_poll(req.uri().path()) {
            // Polling starts no trace: GetInfo polls were ~80% of all traces
            // and hid the pods' traces in Jaeger. A poll inside a caller's
            // trace (rivet-cni's readiness check) stays in that trace.
            return Box::pin(self.inner.call(req));
        }
        let path = req.uri().path();
        let (service, method) = split_grpc_path(path);
        let span = tracing::info_span!(
            "grpc.server",
            // OTel RPC convention: `pkg.Service/Method`, no leading slash.
            otel.name = path.trim_start_matches('/'),
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = service,
            rpc.method = method,
            rpc.grpc.status_code = Empty,
            otel.status_code = Empty,
        );
        if continues_a_trace {
            // Fails only when no OpenTelemetry layer is installed (export
            // off) or the span is disabled; the span is then local-only.
            let _ = span.set_parent(parent);
        }
        let future = span.in_scope(|| self.inner.call(req));
        Box::pin(
            async move {
                let result = future.await;
                let span = tracing::Span::current();
                match &result {
                    Ok(response) => {
                        let code = response
                            .headers()
                            .get("grpc-status")
                            .and_then(|value| value.to_str().ok())
                            .and_then(|value| value.parse::<i64>().ok())
                            .unwrap_or(0);
                        span.record("rpc.grpc.status_code", code);
                        if is_server_error(code) {
                            span.record("otel.status_code", "ERROR");
                        }
                    }
                    Err(_) => {
                        span.record("otel.status_code", "ERROR");
                    }
                }
                result
            }
            .instrument(span),
        )
    }
}

/// Tower layer for a tonic **client** that puts the current span's trace
/// context into every outgoing request (see [`inject_context`]).
///
/// ```no_run
/// use rivet_common::telemetry::TraceContextClientLayer;
/// use rivet_proto::daemon::v1::daemon_client::DaemonClient;
///
/// # async fn call(channel: tonic::transport::Channel) -> Result<(), tonic::Status> {
/// let svc = tower::ServiceBuilder::new()
///     .layer(TraceContextClientLayer::default())
///     .service(channel);
/// let mut client = DaemonClient::new(svc);
/// let info = client
///     .get_info(rivet_proto::daemon::v1::GetInfoRequest {})
///     .await?;
/// # drop(info); Ok(()) }
/// ```
///
/// Construct it with `TraceContextClientLayer::default()` (the type is `#[non_exhaustive]`
/// so that options can be added later).
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct TraceContextClientLayer;

impl<S> Layer<S> for TraceContextClientLayer {
    type Service = TraceContextClient<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceContextClient::new(inner)
    }
}

/// The service made by [`TraceContextClientLayer`]; wrap a
/// `tonic::transport::Channel` in it and hand it to a generated client.
///
/// ```no_run
/// use rivet_common::telemetry::TraceContextClient;
/// use rivet_proto::daemon::v1::daemon_client::DaemonClient;
///
/// # fn f(channel: tonic::transport::Channel) {
/// let client: DaemonClient<TraceContextClient<tonic::transport::Channel>> =
///     DaemonClient::new(TraceContextClient::new(channel));
/// # drop(client); }
/// ```
#[derive(Clone, Debug)]
pub struct TraceContextClient<S> {
    inner: S,
}

impl<S> TraceContextClient<S> {
    /// Wraps `inner`.
    ///
    /// ```
    /// let svc = rivet_common::telemetry::TraceContextClient::new(42);
    /// assert_eq!(svc.into_inner(), 42);
    /// ```
    pub fn new(inner: S) -> Self {
        Self { inner }
    }

    /// Unwraps the inner service.
    ///
    /// ```
    /// let svc = rivet_common::telemetry::TraceContextClient::new("channel");
    /// assert_eq!(svc.into_inner(), "channel");
    /// ```
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody> Service<http::Request<ReqBody>> for TraceContextClient<S>
where
    S: Service<http::Request<ReqBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<ReqBody>) -> Self::Future {
        inject_context(req.headers_mut());
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanKind, TraceId};
    use opentelemetry::{KeyValue, Value};
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{SpanData, SpanExporter};
    use tower::ServiceExt as _;
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// Keeps every exported span in memory (SimpleSpanProcessor exports on end).
    #[derive(Clone, Debug, Default)]
    struct Memory(Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Memory {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }
    }

    /// A thread-local subscriber with an OpenTelemetry layer, exporting to memory.
    fn otel_subscriber() -> (impl tracing::Subscriber + Send + Sync, Memory) {
        install_propagator();
        let memory = Memory::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(memory.clone())
            .build();
        let subscriber = Registry::default().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        (subscriber, memory)
    }

    fn trace_id_of(span: &tracing::Span) -> TraceId {
        span.context().span().span_context().trace_id()
    }

    fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
        span.attributes
            .iter()
            .find(|KeyValue { key: k, .. }| k.as_str() == key)
            .map(|kv| &kv.value)
    }

    #[test]
    fn telemetry_inject_then_extract_round_trips_the_trace_id() {
        let (subscriber, _memory) = otel_subscriber();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("caller");
            let _entered = span.enter();
            let mut headers = HeaderMap::new();
            inject_context(&mut headers);

            let traceparent = headers
                .get("traceparent")
                .expect("injecting inside a span with an OTel context must write traceparent");
            let traceparent = traceparent.to_str().unwrap();
            assert!(traceparent.starts_with("00-"), "W3C version 00: {traceparent}");

            let cx = extract_context(&headers);
            let remote = cx.span().span_context().clone();
            assert!(remote.is_valid(), "extracted context must be valid");
            assert!(remote.is_remote(), "extracted context must be marked remote");
            assert_eq!(remote.trace_id(), trace_id_of(&span));
            assert_eq!(
                remote.span_id(),
                span.context().span().span_context().span_id(),
                "the injected parent is the current span"
            );
        });
    }

    #[test]
    fn telemetry_a_traceparent_carried_in_data_parents_a_later_span() {
        let (subscriber, memory) = otel_subscriber();
        tracing::subscriber::with_default(subscriber, || {
            let cause = tracing::info_span!("create");
            let traceparent = cause.in_scope(current_traceparent);
            assert!(traceparent.starts_with("00-"), "inside a traced span: {traceparent:?}");
            drop(cause);

            let effect = tracing::info_span!("apply");
            assert!(set_parent_from_traceparent(&effect, &traceparent));
            drop(effect);
            let invalid = tracing::info_span!("apply.invalid");
            assert!(!set_parent_from_traceparent(&invalid, "00-zz-yy-01"));
            assert!(!set_parent_from_traceparent(&invalid, ""));
            drop(invalid);
        });
        assert_eq!(tracing::info_span!("outside").in_scope(current_traceparent), "");
        let spans = memory.0.lock().unwrap();
        let by_name = |name: &str| spans.iter().find(|s| s.name == name).expect(name).clone();
        let (cause, effect, invalid) = (by_name("create"), by_name("apply"), by_name("apply.invalid"));
        assert_eq!(effect.span_context.trace_id(), cause.span_context.trace_id());
        assert_eq!(effect.parent_span_id, cause.span_context.span_id());
        assert_ne!(invalid.span_context.trace_id(), cause.span_context.trace_id());
    }

    #[test]
    fn telemetry_inject_without_otel_context_writes_nothing() {
        install_propagator();
        let mut headers = HeaderMap::new();
        headers.insert("x-other", HeaderValue::from_static("kept"));
        inject_context(&mut headers);
        assert!(headers.get("traceparent").is_none());
        assert_eq!(headers.len(), 1);
        let cx = extract_context(&headers);
        assert!(!cx.span().span_context().is_valid());
    }

    #[test]
    fn telemetry_extract_ignores_a_malformed_traceparent() {
        install_propagator();
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", HeaderValue::from_static("00-not-a-trace-01"));
        assert!(!extract_context(&headers).span().span_context().is_valid());
    }

    #[test]
    fn telemetry_split_grpc_path() {
        assert_eq!(
            split_grpc_path("/rivet.daemon.v1.Daemon/GetInfo"),
            ("rivet.daemon.v1.Daemon", "GetInfo")
        );
        assert_eq!(split_grpc_path("/weird"), ("/weird", ""));
        assert_eq!(split_grpc_path(""), ("", ""));
    }

    #[test]
    fn telemetry_export_machinery_is_not_exported() {
        assert!(is_export_machinery("h2::proto::connection"));
        assert!(is_export_machinery("hyper_util::client::legacy"));
        assert!(is_export_machinery("tonic"));
        assert!(!is_export_machinery("rivet_common::telemetry"));
        assert!(!is_export_machinery("h2o"));
    }

    #[test]
    fn telemetry_default_filter_is_validated() {
        // Only meaningful when RUST_LOG does not override the default.
        if std::env::var_os(FILTER_VAR).is_none() {
            let err = env_filter("info,[").unwrap_err();
            assert!(matches!(err, TelemetryError::InvalidDefaultFilter { .. }), "{err:?}");
            assert!(env_filter("info").is_ok());
        }
    }

    /// Server layer + client layer back to back, without a network: the
    /// client injects the caller's context, the server span continues it.
    #[tokio::test]
    async fn telemetry_server_span_continues_the_client_trace() {
        let (subscriber, memory) = otel_subscriber();
        let _default = tracing::subscriber::set_default(subscriber);

        let handler = tower::service_fn(|req: http::Request<()>| async move {
            // The handler runs inside the server span.
            assert_eq!(
                tracing::Span::current().metadata().map(|m| m.name()),
                Some("grpc.server")
            );
            let mut response = http::Response::new(());
            if req.uri().path().ends_with("/Fail") {
                response
                    .headers_mut()
                    .insert("grpc-status", HeaderValue::from_static("13"));
            }
            Ok::<_, Infallible>(response)
        });
        let server = TraceContextServerLayer::default().layer(handler);
        let client = TraceContextClientLayer::default().layer(server);

        let caller = tracing::info_span!("caller");
        async {
            for path in ["/rivet.daemon.v1.Daemon/GetInfo", "/rivet.daemon.v1.Daemon/Fail"] {
                let req = http::Request::builder().uri(path).body(()).unwrap();
                client.clone().oneshot(req).await.unwrap();
            }
        }
        .instrument(caller.clone())
        .await;
        let caller_cx = caller.context().span().span_context().clone();
        drop(caller);

        let spans = memory.0.lock().unwrap().clone();
        let servers: Vec<_> = spans.iter().filter(|s| s.span_kind == SpanKind::Server).collect();
        assert_eq!(servers.len(), 2, "one server span per request: {spans:#?}");
        let ok = servers[0];
        assert_eq!(ok.name, "rivet.daemon.v1.Daemon/GetInfo");
        assert_eq!(ok.span_context.trace_id(), caller_cx.trace_id());
        assert_eq!(ok.parent_span_id, caller_cx.span_id());
        assert!(ok.parent_span_is_remote, "the parent came from headers");
        assert_eq!(attribute(ok, "rpc.system"), Some(&Value::from("grpc")));
        assert_eq!(
            attribute(ok, "rpc.service"),
            Some(&Value::from("rivet.daemon.v1.Daemon"))
        );
        assert_eq!(attribute(ok, "rpc.method"), Some(&Value::from("GetInfo")));
        assert_eq!(attribute(ok, "rpc.grpc.status_code"), Some(&Value::I64(0)));
        assert_eq!(ok.status, opentelemetry::trace::Status::Unset);

        let failed = servers[1];
        assert_eq!(failed.span_context.trace_id(), caller_cx.trace_id());
        assert_eq!(attribute(failed, "rpc.grpc.status_code"), Some(&Value::I64(13)));
        assert!(
            matches!(failed.status, opentelemetry::trace::Status::Error { .. }),
            "INTERNAL marks the server span as an error: {:?}",
            failed.status
        );
    }

    /// Without an incoming traceparent the server span starts a new trace.
    #[tokio::test]
    async fn telemetry_server_span_without_traceparent_is_a_root() {
        let (subscriber, memory) = otel_subscriber();
        let _default = tracing::subscriber::set_default(subscriber);
        let handler =
            tower::service_fn(|_req: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(())) });
        let req = http::Request::builder().uri("/a.B/C").body(()).unwrap();
        TraceContextServerLayer::default()
            .layer(handler)
            .oneshot(req)
            .await
            .unwrap();

        let spans = memory.0.lock().unwrap().clone();
        assert_eq!(spans.len(), 1, "{spans:#?}");
        assert_eq!(spans[0].parent_span_id, opentelemetry::trace::SpanId::INVALID);
        assert_eq!(spans[0].name, "a.B/C");
    }

    /// A health poll that continues no trace opens no span (so no root
    /// trace); the same call from inside a trace is traced (the first test).
    #[tokio::test]
    async fn telemetry_a_health_poll_outside_a_trace_is_not_traced() {
        let (subscriber, memory) = otel_subscriber();
        let _default = tracing::subscriber::set_default(subscriber);
        let handler = tower::service_fn(|_req: http::Request<()>| async {
            assert!(tracing::Span::current().is_none(), "no server span around the handler");
            Ok::<_, Infallible>(http::Response::new(()))
        });
        let server = TraceContextServerLayer::default().layer(handler);
        for path in HEALTH_POLLS {
            let req = http::Request::builder().uri(*path).body(()).unwrap();
            server.clone().oneshot(req).await.unwrap();
        }
        let spans = memory.0.lock().unwrap().clone();
        assert!(spans.is_empty(), "health polls made traces: {spans:#?}");
    }

    /// A link taken inside one span and added to another lands on the
    /// exported span with the first one's trace and span id.
    #[test]
    fn telemetry_trace_link_links_to_the_current_span() {
        let (subscriber, memory) = otel_subscriber();
        tracing::subscriber::with_default(subscriber, || {
            let cause = tracing::info_span!("cause");
            let link = cause.in_scope(TraceLink::current).expect("a traced span is current");
            assert_eq!(link.trace_id(), trace_id_of(&cause).to_string());
            drop(cause);
            let effect = tracing::info_span!(parent: None, "effect");
            link.link_from(&effect);
            drop(effect);
            let spans = memory.0.lock().unwrap().clone();
            let cause = spans.iter().find(|s| s.name == "cause").unwrap();
            let effect = spans.iter().find(|s| s.name == "effect").unwrap();
            assert_ne!(effect.span_context.trace_id(), cause.span_context.trace_id());
            let links: Vec<_> = effect.links.iter().map(|l| l.span_context.clone()).collect();
            assert_eq!(links, std::slice::from_ref(&cause.span_context));
        });
    }

    /// `DaemonClient::new(TraceContextClient<Channel>)` must type-check.
    #[allow(dead_code)]
    fn client_over_a_channel_compiles(channel: tonic::transport::Channel) {
        let mut client = rivet_proto::daemon::v1::daemon_client::DaemonClient::new(TraceContextClient::new(channel));
        drop(client.get_info(rivet_proto::daemon::v1::GetInfoRequest {}));
    }
}
