//! Logs and traces of one invocation. stdout belongs to the result, so logs
//! go to the netconf's `logFile` (appended, one line per event, safe with
//! concurrent invocations) or, without one, to stderr (which the spec allows
//! and runtimes collect) at `warn` unless `logLevel` says otherwise.
//!
//! With `OTEL_EXPORTER_OTLP_ENDPOINT` set, spans are exported over OTLP/gRPC
//! too: the invocation's root span (`cni.add`, `cni.del`, ...) starts the
//! pod's trace, and every daemon call carries its context, so svc-ipam's and
//! svc-endpoint's spans (and svc-loader's below them) are its children.
//! [`Telemetry::shutdown`] flushes the exporter before the process exits.

use std::fs::OpenOptions;
use std::io::IsTerminal as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer as _, Registry};

use crate::netconf::LogLevel;

/// The OTLP endpoint variable.
pub const OTLP_ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// How long the exit waits for pending spans to reach the collector: a
/// collector that is down must not hold up the container runtime.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// Keeps the exporter alive; [`shutdown`](Self::shutdown) flushes it.
pub struct Telemetry {
    export: Option<(SdkTracerProvider, tokio::runtime::Runtime)>,
    log_problem: Option<String>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("exporting", &self.export.is_some())
            .finish_non_exhaustive()
    }
}

/// Crates whose spans never go to the collector: the exporter's transport.
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
    CRATES.contains(&target.split("::").next().unwrap_or(target))
}

impl Telemetry {
    /// Installs the global subscriber. Never fails: a log file that cannot
    /// be opened falls back to stderr (noted in [`log_problem`](Self::log_problem)),
    /// an exporter that cannot be built is left out.
    pub fn init(log_file: Option<&Path>, level: Option<LogLevel>) -> Self {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let mut log_problem = None;
        let file = log_file.and_then(|path| {
            if let Some(dir) = path.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            match OpenOptions::new().create(true).append(true).open(path) {
                Ok(file) => Some(file),
                Err(e) => {
                    log_problem = Some(format!(
                        "cannot open logFile {}: {e}; logging to stderr",
                        path.display()
                    ));
                    None
                }
            }
        });
        let level = level.unwrap_or(if file.is_some() { LogLevel::Info } else { LogLevel::Warn });
        let filter = EnvFilter::new(format!(
            "warn,rivet_cni={level},rivet_common={level}",
            level = level.as_str()
        ));
        // At debug and trace, every step's span logs its duration when it ends.
        let span_events = if matches!(level, LogLevel::Debug | LogLevel::Trace) {
            FmtSpan::CLOSE
        } else {
            FmtSpan::NONE
        };
        let fmt = match file {
            Some(file) => tracing_subscriber::fmt::layer()
                .with_writer(Mutex::new(file))
                .with_ansi(false)
                .with_span_events(span_events)
                .with_filter(filter)
                .boxed(),
            None => tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .with_span_events(span_events)
                .with_filter(filter)
                .boxed(),
        };
        let export = match std::env::var(OTLP_ENDPOINT_VAR) {
            Ok(endpoint) if !endpoint.trim().is_empty() => match otlp_export() {
                Ok(export) => Some(export),
                Err(e) => {
                    log_problem = Some(format!("OTLP export to {endpoint} is off: {e}"));
                    None
                }
            },
            _ => None,
        };
        let mut layers = vec![fmt];
        if let Some((provider, _)) = &export {
            layers.push(
                tracing_opentelemetry::layer()
                    .with_tracer(provider.tracer("rivet-cni"))
                    .with_filter(filter_fn(|meta| {
                        !is_export_machinery(meta.target()) && *meta.level() <= tracing::Level::INFO
                    }))
                    .boxed(),
            );
        }
        // Fails only when a subscriber exists already (a test harness).
        let _ = Registry::default().with(layers).try_init();
        if let Some((provider, _)) = &export {
            opentelemetry::global::set_tracer_provider(provider.clone());
        }
        if let Some(problem) = &log_problem {
            tracing::warn!("{problem}");
        }
        Self { export, log_problem }
    }

    /// Why logging or export is not as configured, if it is not.
    pub fn log_problem(&self) -> Option<&str> {
        self.log_problem.as_deref()
    }

    /// Exports every pending span (bounded by [`FLUSH_TIMEOUT`]).
    pub fn shutdown(mut self) {
        if let Some((provider, runtime)) = self.export.take() {
            if let Err(e) = provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
                tracing::warn!(error = %e, "some spans may not have reached the collector");
            }
            runtime.shutdown_background();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some((provider, runtime)) = self.export.take() {
            let _ = provider.shutdown_with_timeout(FLUSH_TIMEOUT);
            runtime.shutdown_background();
        }
    }
}

/// The OTLP/gRPC exporter on its own one-thread runtime (the flush at exit
/// blocks; it must not need the invocation's runtime thread).
fn otlp_export() -> Result<(SdkTracerProvider, tokio::runtime::Runtime), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rivet-cni-otlp")
        .enable_all()
        .build()
        .map_err(|e| format!("starting the export runtime: {e}"))?;
    let exporter = {
        let _entered = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder().with_tonic().build()
    };
    let exporter = match exporter {
        Ok(exporter) => exporter,
        Err(e) => {
            runtime.shutdown_background();
            return Err(e.to_string());
        }
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("rivet-cni")
        .build();
    let provider = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_batch_exporter(exporter)
        .build();
    Ok((provider, runtime))
}
