//! Prometheus metrics and `/healthz` on a per-daemon HTTP listener.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// Whether a daemon can do its job, as `/healthz` reports it.
///
/// ```
/// let health = rivet_common::metrics::Health::default();
/// assert!(health.check().is_err(), "starting is not healthy yet");
/// health.set_serving();
/// assert!(health.check().is_ok());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<Mutex<HealthState>>);

#[derive(Debug, Clone, Default)]
enum HealthState {
    #[default]
    Starting,
    Serving,
    Unhealthy(String),
}

impl Health {
    /// The daemon serves requests.
    pub fn set_serving(&self) {
        *self.0.lock().expect("health lock poisoned") = HealthState::Serving;
    }

    /// The daemon cannot serve, for `reason`.
    pub fn set_unhealthy(&self, reason: impl Into<String>) {
        *self.0.lock().expect("health lock poisoned") = HealthState::Unhealthy(reason.into());
    }

    /// Ok when serving, else the reason.
    pub fn check(&self) -> Result<(), String> {
        match &*self.0.lock().expect("health lock poisoned") {
            HealthState::Serving => Ok(()),
            HealthState::Starting => Err("starting".into()),
            HealthState::Unhealthy(reason) => Err(reason.clone()),
        }
    }
}

/// Why the metrics listener failed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be bound.
    #[error("binding the metrics listener on {address}: {source}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving metrics on {address}: {source}")]
    Serve {
        /// The address.
        address: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

#[derive(Clone)]
struct AppState {
    registry: Arc<Registry>,
    health: Health,
}

/// A bound HTTP listener serving `/metrics` (OpenMetrics text) and `/healthz`.
#[derive(Debug)]
pub struct MetricsServer {
    listener: tokio::net::TcpListener,
    address: SocketAddr,
}

impl MetricsServer {
    /// Binds `address` (port 0 picks a free port).
    pub async fn bind(address: SocketAddr) -> Result<Self, MetricsError> {
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|source| MetricsError::Bind { address, source })?;
        let address = listener
            .local_addr()
            .map_err(|source| MetricsError::Bind { address, source })?;
        Ok(Self { listener, address })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }

    /// Serves until `shutdown` completes.
    pub async fn serve(
        self,
        registry: Arc<Registry>,
        health: Health,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), MetricsError> {
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .with_state(AppState { registry, health });
        let address = self.address;
        tracing::info!(%address, "serving /metrics and /healthz");
        axum::serve(self.listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|source| MetricsError::Serve { address, source })
    }
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("encoding metrics: {e}"),
        ),
    }
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    match state.health.check() {
        Ok(()) => (StatusCode::OK, "ok".to_string()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    async fn get(addr: SocketAddr, path: &str) -> String {
        crate::testing::http_get(addr, path).await.unwrap()
    }

    #[tokio::test]
    async fn serves_metrics_and_health() {
        let mut registry = Registry::with_prefix("rivet");
        let c = Counter::<u64>::default();
        registry.register("test_events", "Test events", c.clone());
        c.inc();
        let health = Health::default();
        let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = server.local_addr();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.serve(Arc::new(registry), health.clone(), async {
            let _ = rx.await;
        }));

        let body = get(addr, "/metrics").await;
        assert!(
            body.contains("rivet_test_events_total 1"),
            "metrics must be exported: {body}"
        );
        assert!(
            get(addr, "/healthz").await.starts_with("HTTP/1.1 503"),
            "starting is unhealthy"
        );
        health.set_serving();
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        tx.send(()).unwrap();
        task.await.unwrap().unwrap();
    }
}
