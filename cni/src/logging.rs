//! Logs and traces of one invocation. stdout belongs to the result, so logs
//! go to the netconf's `logFile` (appended, one line per event, safe with
//! concurrent invocations) or, without one, to stderr (which the spec allows
//! and runtimes collect) at `warn` unless `logLevel` says otherwise.
//!
//! With the netconf's `tracing.otlpEndpoint`, or else the runtime's
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, spans are exported over OTLP/gRPC too
//! (service `rivet-cni`): the invocation's root span (`cni.add`, `cni.del`, ...) starts the
//! pod's trace, and every daemon call carries its context, so svc-ipam's and
//! svc-endpoint's spans (and svc-loader's below them) are its children.
//! [`Telemetry::shutdown`] flushes the exporter before the process exits.

use std::fs::OpenOptions;
use std::io::IsTerminal as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use rivet_common::telemetry::OtlpExporter;
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer as _, Registry};

use crate::netconf::LogLevel;

/// The `service.name` of rivet-cni's spans.
pub const SERVICE_NAME: &str = "rivet-cni";

/// How long the exit waits for pending spans to reach the collector: a
/// collector that is down must not hold up the container runtime.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// Keeps the exporter alive; [`shutdown`](Self::shutdown) flushes it.
pub struct Telemetry {
    export: Option<OtlpExporter>,
    log_problem: Option<String>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("exporting", &self.export.is_some())
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    /// Installs the global subscriber. Never fails: a log file that cannot
    /// be opened falls back to stderr (noted in [`log_problem`](Self::log_problem)),
    /// an exporter that cannot be built is left out. `otlp_endpoint` (the
    /// netconf's) wins over `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn init(log_file: Option<&Path>, level: Option<LogLevel>, otlp_endpoint: Option<&str>) -> Self {
        rivet_common::telemetry::install_propagator();
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
        // Each invocation is an instance of its own (OpenTelemetry's
        // `service.instance.id` is unique per process).
        let instance = [(
            "service.instance.id".to_owned(),
            rivet_common::grpc::BootId::random().to_string(),
        )];
        let export = match otlp_endpoint {
            Some(endpoint) => OtlpExporter::to_endpoint(SERVICE_NAME, &instance, endpoint).map(Some),
            None => OtlpExporter::from_env(SERVICE_NAME, &instance),
        };
        let export = match export {
            Ok(export) => export,
            Err(e) => {
                log_problem = Some(format!("OTLP export is off: {e}"));
                None
            }
        };
        let mut layers = vec![fmt];
        if let Some(export) = &export {
            layers.push(
                export
                    .layer()
                    .with_filter(filter_fn(|meta| *meta.level() <= tracing::Level::INFO))
                    .boxed(),
            );
        }
        // Fails only when a subscriber exists already (a test harness).
        let _ = Registry::default().with(layers).try_init();
        if let Some(export) = &export {
            export.install_global();
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
        if let Some(export) = self.export.take()
            && let Err(e) = export.shutdown(FLUSH_TIMEOUT)
        {
            tracing::warn!(error = %e, "some spans may not have reached the collector");
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(export) = self.export.take() {
            let _ = export.shutdown(FLUSH_TIMEOUT);
        }
    }
}
