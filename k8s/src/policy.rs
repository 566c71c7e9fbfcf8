//! Policies from the API server: a `NetworkPolicy` or `RivetNetworkPolicy`
//! object becomes the same `rivet_policy::Policy` as the same document read
//! from a file.

use rivet_policy::{Policy, PolicyError};
use serde::Serialize;
use serde_json::{Map, Value};

/// Parses a policy object read from the API (`k8s_openapi`'s NetworkPolicy or
/// a [`crate::RivetNetworkPolicy`]) with rivet-policy's parser, so that it
/// is validated exactly like a file. Only `name` and `namespace` of the
/// metadata are kept (managedFields and the rest would only bloat the stored
/// document); `status` is dropped.
///
/// ```
/// use rivet_k8s::kube::core::ObjectMeta;
/// use rivet_k8s::{RivetNetworkPolicy, RivetNetworkPolicySpec, policy_from_object};
///
/// let mut object = RivetNetworkPolicy::new("deny-all", RivetNetworkPolicySpec {
///     pod_selector: Some(Default::default()),
///     ..Default::default()
/// });
/// object.metadata.namespace = Some("shop".into());
/// let policy = policy_from_object(&object)?;
/// assert_eq!(policy.key().to_string(), "RivetNetworkPolicy/shop/deny-all");
/// # Ok::<(), rivet_policy::PolicyError>(())
/// ```
pub fn policy_from_object<K: Serialize>(object: &K) -> Result<Policy, PolicyError> {
    let syntax = |reason: String| PolicyError::Syntax {
        path: String::new(),
        reason,
    };
    let Value::Object(mut fields) =
        serde_json::to_value(object).map_err(|e| syntax(format!("serialising the object: {e}")))?
    else {
        return Err(syntax("the object does not serialise to a JSON object".into()));
    };
    fields.remove("status");
    if let Some(Value::Object(metadata)) = fields.get_mut("metadata") {
        let kept: Map<String, Value> = ["name", "namespace"]
            .into_iter()
            .filter_map(|key| metadata.remove(key).map(|value| (key.to_string(), value)))
            .collect();
        *metadata = kept;
    }
    Policy::parse(&Value::Object(fields).to_string())
}
