//! Failed calls to the Kubernetes API, typed: the verb and resource named, a
//! refusal by RBAC (403) told apart so operators see a missing permission,
//! not a generic failure.

/// One failed call to the API server.
#[derive(Debug, thiserror::Error)]
#[error("{verb} {resource}: {}", describe(.source))]
pub struct ApiError {
    /// The verb (`list`, `watch`, `patch`, `apply`, `delete`, ...).
    pub verb: &'static str,
    /// The resource and object (`pods`, `nodes/node-1`, `rivetendpoints shop/web-1`).
    pub resource: String,
    /// kube's error.
    #[source]
    pub source: kube::Error,
}

impl ApiError {
    /// A failed `verb` on `resource`.
    pub fn new(verb: &'static str, resource: impl Into<String>, source: kube::Error) -> Self {
        Self {
            verb,
            resource: resource.into(),
            source,
        }
    }

    /// The API server refused it for lack of permission (403).
    pub fn is_forbidden(&self) -> bool {
        is_forbidden(&self.source)
    }

    /// The object (or its kind) does not exist (404).
    pub fn is_not_found(&self) -> bool {
        status_code(&self.source) == Some(404)
    }

    /// A short label of its kind for metrics: `forbidden`, `not_found`,
    /// `conflict`, `invalid`, `unavailable` or `other`.
    pub fn kind_label(&self) -> &'static str {
        kind_label(&self.source)
    }
}

pub use rivet_k8s::{error_kind as kind_label, status_code};

/// Whether the API server refused a call for lack of permission (403).
pub fn is_forbidden(e: &kube::Error) -> bool {
    status_code(e) == Some(403)
}

fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) if status.code == 403 => format!(
            "forbidden by the API server's RBAC (403): the ServiceAccount lacks this permission (deploy/rbac/svc-k8s-sync.yaml grants svc-k8s-sync's): {}",
            status.message
        ),
        kube::Error::Api(status) => format!(
            "the API server answered {} ({}): {}",
            status.code, status.reason, status.message
        ),
        other => format!("the API server was not reached: {other}"),
    }
}
