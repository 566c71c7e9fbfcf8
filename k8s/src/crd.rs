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

/// The name of the kustomization in `deploy/crds/` (deploy/'s base lists
/// the CRDs through it).
pub const CRD_KUSTOMIZATION: &str = "kustomization.yaml";

/// The kustomization of `deploy/crds/`, listing every file of
/// [`crd_manifests`]: `kubectl apply -k deploy/` installs the CRDs through
/// it, so a new CRD is in deploy/ as soon as `cargo xtask crds` ran.
pub fn crd_kustomization() -> String {
    let mut text = String::from(
        "# Generated from rivet-k8s (k8s/src/crd/) by `cargo xtask crds`; do not edit.\n\
         apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\nresources:\n",
    );
    for manifest in crd_manifests() {
        text.push_str(&format!("- {}\n", manifest.file_name));
    }
    text
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
