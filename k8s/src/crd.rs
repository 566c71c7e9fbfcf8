//! The `rivet.io/v1` custom resources and their definitions.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

// Clippy reads the repeated `type_ = "string"` of several
// `#[kube(printcolumn(..))]` entries as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
pub mod endpoint;
#[allow(clippy::duplicated_attributes)]
pub mod identity;
pub mod network_policy;
#[allow(clippy::duplicated_attributes)]
pub mod node;

/// The API group of every Rivet resource.
pub const API_GROUP: &str = "rivet.io";
/// The one served and stored version.
pub const API_VERSION: &str = "v1";

/// Every Rivet CustomResourceDefinition, sorted by name.
pub fn crds() -> Vec<CustomResourceDefinition> {
    let mut crds = vec![
        network_policy::RivetNetworkPolicy::crd(),
        endpoint::RivetEndpoint::crd(),
        node::RivetNode::crd(),
        identity::RivetIdentity::crd(),
    ];
    crds.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    crds
}

/// One CRD as the file `deploy/crds/` holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrdManifest {
    /// `<plural>.rivet.io.yaml`.
    pub file_name: String,
    /// The YAML document, with a header saying it is generated.
    pub yaml: String,
}

/// The files of `deploy/crds/`: one per CRD, named after the CRD
/// (`rivetendpoints.rivet.io.yaml`).
pub fn crd_manifests() -> Vec<CrdManifest> {
    crds()
        .into_iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().expect("a derived CRD has a name");
            let body = serde_norway::to_string(&crd).expect("a CRD serialises to YAML");
            CrdManifest {
                file_name: format!("{name}.yaml"),
                yaml: format!("# Generated from rivet-k8s (k8s/src/crd/) by `cargo xtask crds`; do not edit.\n{body}"),
            }
        })
        .collect()
}
