//! `RivetIdentity`: one security identity, cluster-scoped, named by its
//! number (`"70001"`), holding the identity labels it was allocated for.
//! svc-identity's `kubernetes` store creates and reads them.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The spec of a `RivetIdentity` (`rivet.io/v1`), cluster-scoped; short name `rid`.
/// The object's name is the numeric identity.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "rivet.io",
    version = "v1",
    kind = "RivetIdentity",
    shortname = "rid",
    category = "rivet",
    derive = "PartialEq",
    doc = "A Rivet security identity: the object's name is the numeric identity, spec.labels the label set it stands for.",
    printcolumn(name = "Labels", type_ = "string", json_path = ".spec.labels"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
pub struct RivetIdentitySpec {
    /// The identity labels, `source:key=value`, sorted and unique.
    pub labels: Vec<String>,
}
