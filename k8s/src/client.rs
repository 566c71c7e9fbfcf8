//! Building a kube client: from a kubeconfig file or, in a pod, from the
//! ServiceAccount the kubelet mounts.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use kube::config::{InClusterError, KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::{Client, Config};

/// How a daemon reaches the API server: the value of its `--kubeconfig`-like
/// flag, `in-cluster` or a kubeconfig path.
///
/// ```
/// use rivet_k8s::ClusterAccess;
///
/// assert_eq!("in-cluster".parse::<ClusterAccess>()?, ClusterAccess::InCluster);
/// assert_eq!(
///     "/etc/rivet/kubeconfig".parse::<ClusterAccess>()?,
///     ClusterAccess::Kubeconfig("/etc/rivet/kubeconfig".into())
/// );
/// assert!("".parse::<ClusterAccess>().is_err());
/// # Ok::<(), rivet_k8s::ClientError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterAccess {
    /// A kubeconfig file; its current context is used.
    Kubeconfig(PathBuf),
    /// The pod's ServiceAccount (`KUBERNETES_SERVICE_HOST`/`_PORT`, the
    /// token and CA under /var/run/secrets/kubernetes.io/serviceaccount).
    InCluster,
}

impl ClusterAccess {
    /// The value that selects [`ClusterAccess::InCluster`].
    pub const IN_CLUSTER: &'static str = "in-cluster";

    /// Reads the configuration and builds a client. Nothing is sent to the
    /// API server yet.
    pub async fn client(&self) -> Result<Client, ClientError> {
        let config = match self {
            Self::Kubeconfig(path) => {
                let failed = |source| ClientError::Kubeconfig {
                    path: path.clone(),
                    source,
                };
                let kubeconfig = Kubeconfig::read_from(path).map_err(failed)?;
                Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                    .await
                    .map_err(failed)?
            }
            Self::InCluster => Config::incluster().map_err(|source| ClientError::InCluster { source })?,
        };
        Client::try_from(config).map_err(|source| ClientError::Build {
            access: self.to_string(),
            source,
        })
    }
}

impl fmt::Display for ClusterAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kubeconfig(path) => write!(f, "kubeconfig {}", path.display()),
            Self::InCluster => f.write_str(Self::IN_CLUSTER),
        }
    }
}

impl FromStr for ClusterAccess {
    type Err = ClientError;

    fn from_str(s: &str) -> Result<Self, ClientError> {
        match s {
            "" => Err(ClientError::EmptyAccess),
            Self::IN_CLUSTER => Ok(Self::InCluster),
            path => Ok(Self::Kubeconfig(path.into())),
        }
    }
}

/// Building a client failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The flag was empty.
    #[error("no cluster access given: expected `in-cluster` or the path of a kubeconfig")]
    EmptyAccess,
    /// The kubeconfig could not be read or used.
    #[error("reading kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        source: KubeconfigError,
    },
    /// Not in a pod, or the ServiceAccount files are missing.
    #[error("reading the in-cluster ServiceAccount configuration: {source}")]
    InCluster {
        /// Why.
        source: InClusterError,
    },
    /// The HTTP client could not be built (TLS configuration).
    #[error("building the Kubernetes client for {access}: {source}")]
    Build {
        /// Which access.
        access: String,
        /// Why.
        source: kube::Error,
    },
}

/// The HTTP status of an API error, when the server answered.
pub fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// A metric label for the kind of an API error, the same in every
/// component: `forbidden`, `not_found`, `conflict`, `invalid`,
/// `unavailable` (no answer, or a 5xx) or `other`.
///
/// ```
/// let refused = kube::Error::Api(kube::core::Status::failure("no", "Forbidden").with_code(403).boxed());
/// assert_eq!(rivet_k8s::error_kind(&refused), "forbidden");
/// ```
pub fn error_kind(e: &kube::Error) -> &'static str {
    match status_code(e) {
        Some(403) => "forbidden",
        Some(404) => "not_found",
        Some(409) => "conflict",
        Some(422) => "invalid",
        Some(500..=599) | None => "unavailable",
        Some(_) => "other",
    }
}
