//! The kvstore (etcd) the operator writes to: the identity GC, the
//! heartbeat and the node and service mirrors share one client and the key
//! layout of DESIGN.md §4 ([`Layout`], owned by svc-identity).

use std::time::Duration;

pub use svc_identity::etcd_backend::Layout;

/// Where the kvstore is (flags shared by every kvstore duty). Without
/// `--etcd-endpoints` the kvstore duties are off (the CRD identity store).
#[derive(Debug, Clone, clap::Args)]
pub struct KvstoreArgs {
    /// etcd endpoints (`http://host:port`, repeat or comma-separate). The
    /// same cluster svc-identity's `etcd` store uses.
    #[arg(long, env = "RIVET_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,

    /// Key prefix, as svc-identity's `--kvstore-prefix`.
    #[arg(long, env = "RIVET_KVSTORE_PREFIX", default_value = "rivet/state/")]
    pub kvstore_prefix: String,

    /// This cluster's name, as svc-identity's `--cluster-name`.
    #[arg(long, env = "RIVET_CLUSTER_NAME", default_value = "default")]
    pub cluster_name: String,
}

/// Why the kvstore could not be reached.
#[derive(Debug, thiserror::Error)]
#[error("connecting to etcd at {endpoints}: {source}")]
pub struct ConnectError {
    /// The endpoints tried.
    pub endpoints: String,
    /// etcd-client's error.
    #[source]
    pub source: etcd_client::Error,
}

impl KvstoreArgs {
    /// Whether a kvstore is configured.
    pub fn enabled(&self) -> bool {
        !self.etcd_endpoints.is_empty()
    }

    /// The key layout under `--kvstore-prefix` for `--cluster-name`.
    pub fn layout(&self) -> Layout {
        Layout::new(&self.kvstore_prefix, &self.cluster_name)
    }

    /// A client of `--etcd-endpoints`. No per-request timeout (it would cut
    /// watches): duties bound each call with `tokio::time::timeout`.
    pub async fn connect(&self) -> Result<etcd_client::Client, ConnectError> {
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        etcd_client::Client::connect(&self.etcd_endpoints, Some(options))
            .await
            .map_err(|source| ConnectError {
                endpoints: self.etcd_endpoints.join(","),
                source,
            })
    }
}

/// Why one etcd request of a duty failed.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// etcd refused or failed it.
    #[error("{action}: {source}")]
    Etcd {
        /// What was being done, to which key.
        action: String,
        /// etcd-client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// etcd did not answer in time.
    #[error("{action}: no answer from etcd within {timeout:?}")]
    Timeout {
        /// What was being done, to which key.
        action: String,
        /// The bound.
        timeout: Duration,
    },
}

impl RequestError {
    /// The metric label: `etcd_error` or `timeout`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Etcd { .. } => "etcd_error",
            Self::Timeout { .. } => "timeout",
        }
    }
}

/// Runs one etcd request bounded by `timeout` (the client has no
/// per-request timeout); `action` names it in the error.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use rivet_operator::kvstore::{RequestError, request};
/// let never = std::future::pending::<Result<(), etcd_client::Error>>();
/// let e = request(|| "putting k".into(), Duration::from_millis(1), never).await.unwrap_err();
/// assert!(matches!(e, RequestError::Timeout { .. }));
/// assert_eq!(e.to_string(), "putting k: no answer from etcd within 1ms");
/// # }
/// ```
pub async fn request<T>(
    action: impl FnOnce() -> String,
    timeout: Duration,
    request: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RequestError> {
    match tokio::time::timeout(timeout, request).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(source)) => Err(RequestError::Etcd {
            action: action(),
            source,
        }),
        Err(_) => Err(RequestError::Timeout {
            action: action(),
            timeout,
        }),
    }
}
