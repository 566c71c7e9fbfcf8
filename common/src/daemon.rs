//! The run loop every daemon's `main` ends with: serve gRPC on its socket and
//! metrics on HTTP until SIGTERM/SIGINT, then drain and stop both.

use std::process::ExitCode;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tonic::service::Routes;

use crate::access::{AccessPolicy, ReadOnlyMethods};
use crate::config::CommonArgs;
use crate::controller::{Controller, Controllers};
use crate::grpc::{self, DaemonIdentity, ServeError};
use crate::metrics::{Health, MetricsError, MetricsServer};
use crate::privileges::{self, Capability, Dropped, PrivilegeError};
use crate::socket::{SocketError, SocketOptions, UnixSocketListener};
use crate::telemetry::{self, TelemetryError, TelemetryGuard, TelemetryOptions};

/// Why a daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Its socket could not be bound.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// gRPC serving failed.
    #[error(transparent)]
    Serve(#[from] ServeError),
    /// The metrics listener failed.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
}

/// Logs and traces of the daemon `identity` names, as the common flags
/// say: text or JSON on stderr at `info` (or `RUST_LOG`), OTLP when
/// configured, with the OpenTelemetry resource attributes `service.name`,
/// `service.version`, `service.instance.id` (the boot id every response
/// carries, so a trace names the process start that served it) and
/// `k8s.node.name`.
pub fn init_telemetry(common: &CommonArgs, identity: &DaemonIdentity) -> Result<TelemetryGuard, TelemetryError> {
    telemetry::init(TelemetryOptions {
        service_name: identity.name.into(),
        log_format: common.log_format,
        default_filter: "info".into(),
        resource_attributes: vec![
            ("service.version".into(), identity.version.into()),
            ("service.instance.id".into(), identity.boot_id.to_string()),
            ("k8s.node.name".into(), identity.node_name.clone()),
        ],
    })
}

/// A daemon's exit: success, or its error chain on stderr (prefixed with
/// its name) and status 1.
///
/// ```
/// let status = rivet_common::daemon::exit("svc-x", Err::<(), _>("no socket dir"));
/// assert_eq!(status, std::process::ExitCode::FAILURE);
/// ```
pub fn exit<E: std::fmt::Display>(name: &str, result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Drops the process to `--user` (when given) and to exactly the
/// capabilities in `keep`, refusing to go on with anything wider
/// ([`privileges::drop_privileges`]). Call it first in `main`, before the
/// tokio runtime starts threads; log the result once telemetry is up.
pub fn drop_privileges(
    common: &CommonArgs,
    name: &'static str,
    keep: &[Capability],
) -> Result<Dropped, PrivilegeError> {
    let account = common.user.as_deref().map(privileges::resolve_user).transpose()?;
    privileges::drop_privileges(name, account.as_ref(), keep)
}

/// Binds the daemon's socket `<socket-dir>/<name>.sock` with the common
/// flags' group, access policy (`--allowed-uids`, `--read-only-gids`;
/// `read_only` lists the daemon's read-only methods) and connection limit
/// (`--max-connections`). Call it before
/// touching state: it holds the single-instance lock, so two instances never
/// share a state dir.
pub fn bind_socket(
    common: &CommonArgs,
    name: &str,
    read_only: ReadOnlyMethods,
) -> Result<UnixSocketListener, SocketError> {
    UnixSocketListener::bind(
        &common.socket_path(name),
        &SocketOptions {
            group: common.socket_gid,
            max_connections: common.max_connections,
            access: AccessPolicy {
                full_uids: common.allowed_uids.clone(),
                read_only_gids: common.read_only_gids.clone(),
                read_only_methods: read_only,
            },
            ..SocketOptions::default()
        },
    )
}

/// Serves `routes` (plus the `Daemon` info service, which reports
/// `controllers`) on `listener`, and `/metrics` + `/healthz` when
/// `--metrics-address` is set (the controller `metrics-server`), until
/// SIGTERM or SIGINT; then stops every controller and waits for them.
pub async fn run(
    common: &CommonArgs,
    listener: UnixSocketListener,
    identity: DaemonIdentity,
    controllers: Controllers,
    routes: Routes,
    registry: Registry,
    health: Health,
) -> Result<(), DaemonError> {
    let mut registry = registry;
    listener.access_metrics().register(&mut registry);
    controllers.register_metrics(&mut registry);
    if let Some(address) = common.metrics_address {
        serve_metrics(address, &controllers, registry, health.clone()).await?;
    }
    health.set_serving();
    let result = grpc::serve_unix(listener, identity, controllers.clone(), routes, grpc::shutdown_signal()).await;
    health.set_unhealthy("shutting down");
    controllers.shutdown().await;
    Ok(result?)
}

/// Serves `/metrics` (of `registry`) and `/healthz` (of `health`) on
/// `address` under the controller `metrics-server` of `controllers`, until
/// they shut down. The address is bound before this returns: one in use
/// fails the start; a server that fails later is bound and started again.
pub async fn serve_metrics(
    address: std::net::SocketAddr,
    controllers: &Controllers,
    registry: Registry,
    health: Health,
) -> Result<(), MetricsError> {
    let bound = Arc::new(std::sync::Mutex::new(Some(MetricsServer::bind(address).await?)));
    let registry = Arc::new(registry);
    controllers.supervise(Controller::new("metrics-server"), move |progress| {
        let (bound, registry, health) = (bound.clone(), registry.clone(), health.clone());
        async move {
            let taken = bound.lock().unwrap_or_else(|e| e.into_inner()).take();
            let server = match taken {
                Some(server) => server,
                None => MetricsServer::bind(address).await?,
            };
            progress.ok();
            // Until the daemon's shutdown cancels it.
            server.serve(registry, health, std::future::pending()).await
        }
    });
    Ok(())
}
