//! deploy/'s Jaeger (`base/jaeger/`: pods labelled
//! `app.kubernetes.io/name=jaeger` in `kube-system`, query API on 16686)
//! read from a worker's network namespace, where its pod address is routed
//! (the node's own pods, the others' by Rivet's routing). The API server's
//! service proxy cannot be used: the control plane routes only
//! `Node.spec.podCIDRs`, and Rivet's operator hands out pod CIDRs in
//! RivetNodes. The GET is the host's static busybox `wget` run in the
//! namespace (`nsenter --net`), so no thread of the test changes namespace.
//!
//! ```no_run
//! # async fn t(cluster: &rivet_e2e::kube_cluster::KubeCluster) -> Result<(), rivet_e2e::kube_cluster::KubeClusterError> {
//! use rivet_e2e::kube_cluster::jaeger::ClusterJaeger;
//! let jaeger = ClusterJaeger::new(cluster.admin_client(), &cluster.workers()[0].netns.path());
//! // Jaeger's OTLP JSON (rivet_testkit::jaeger::parse_traces reads it); None: 404.
//! let body = jaeger.get("/api/v3/services").await?;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams};

use super::{KubeClusterError, io_err};

/// deploy/'s Jaeger pods: namespace and label selector.
pub const JAEGER_PODS: (&str, &str) = ("kube-system", "app.kubernetes.io/name=jaeger");

/// Jaeger's query API port.
pub const QUERY_PORT: u16 = 16686;

/// The host's static busybox (its `wget`).
const BUSYBOX: &str = "/bin/busybox";

/// The in-cluster Jaeger's query API.
#[derive(Clone)]
pub struct ClusterJaeger {
    client: Client,
    netns: PathBuf,
}

impl std::fmt::Debug for ClusterJaeger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterJaeger")
            .field("netns", &self.netns)
            .finish_non_exhaustive()
    }
}

impl ClusterJaeger {
    /// Finds the Jaeger pod with `client` and queries it from the network
    /// namespace at `netns` (a worker's).
    pub fn new(client: Client, netns: &Path) -> Self {
        Self {
            client,
            netns: netns.to_path_buf(),
        }
    }

    /// The running Jaeger pod's address.
    ///
    /// # Errors
    /// The API failed, or no Jaeger pod has an address yet.
    pub async fn address(&self) -> Result<String, KubeClusterError> {
        let (namespace, selector) = JAEGER_PODS;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let list = pods
            .list(&ListParams::default().labels(selector))
            .await
            .map_err(|source| KubeClusterError::Api {
                action: format!("listing the Jaeger pods ({selector})"),
                source,
            })?;
        list.items
            .iter()
            .filter_map(|p| p.status.as_ref())
            .filter(|s| s.phase.as_deref() == Some("Running"))
            .find_map(|s| s.pod_ip.clone())
            .ok_or_else(|| KubeClusterError::Options(format!("no running Jaeger pod ({selector}) has an address")))
    }

    /// GETs `path` of Jaeger's query API (`/api/v3/...`); `None` when
    /// Jaeger answers 404 (its "no traces found").
    ///
    /// # Errors
    /// No Jaeger pod, or the GET failed otherwise.
    pub async fn get(&self, path: &str) -> Result<Option<String>, KubeClusterError> {
        let address = self.address().await?;
        let url = format!("http://{address}:{QUERY_PORT}{path}");
        let out = Command::new("nsenter")
            .arg(format!("--net={}", self.netns.display()))
            // Debian's busybox wget crashes with its own -T: coreutils' timeout bounds it.
            .args(["timeout", "20", BUSYBOX, "wget", "-q", "-O", "-", &url])
            .output()
            .map_err(io_err(format!("running busybox wget {url}")))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned()))
        } else if stderr.contains("404") {
            Ok(None)
        } else {
            Err(KubeClusterError::Io {
                context: format!("GET {url} from {}", self.netns.display()),
                source: std::io::Error::other(format!("{}: {}", out.status, stderr.trim())),
            })
        }
    }
}
