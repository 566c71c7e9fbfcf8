//! A policy object from the API becomes the same policy as its YAML file.

use rivet_k8s::k8s_openapi::api::networking::v1::NetworkPolicy;
use rivet_k8s::{RivetNetworkPolicy, policy_from_object};
use rivet_policy::Policy;

/// Every field of a RivetNetworkPolicy spec rivet-policy knows: a field the
/// CRD type dropped would make the two policies differ.
const EVERY_FIELD: &str = include_str!("every-field-rnp.yaml");

#[test]
fn rivet_network_policy_object_is_the_same_policy_as_its_yaml() {
    let from_file = Policy::parse(EVERY_FIELD).expect("the document is valid");
    let object: RivetNetworkPolicy = serde_norway::from_str(EVERY_FIELD).expect("the CRD type reads the document");
    let from_api = policy_from_object(&object).expect("the object is valid");
    assert_eq!(from_api.key(), from_file.key());
    assert!(
        from_api.same_spec(&from_file),
        "from the API: {}\nfrom the file: {}",
        from_api.normalized_json(),
        from_file.normalized_json()
    );
}

#[test]
fn api_metadata_and_status_are_ignored_and_not_stored() {
    let mut object: RivetNetworkPolicy = serde_norway::from_str(EVERY_FIELD).unwrap();
    object.metadata.uid = Some("0f1e2d3c".into());
    object.metadata.resource_version = Some("4711".into());
    object.metadata.managed_fields = Some(vec![Default::default()]);
    let policy = policy_from_object(&object).unwrap();
    assert!(policy.same_spec(&Policy::parse(EVERY_FIELD).unwrap()));
    assert!(!policy.document().contains("4711"), "{}", policy.document());
}

#[test]
fn an_invalid_object_is_refused_with_the_field_path() {
    let text = EVERY_FIELD.replace("endPort: 5440", "endPort: 5000");
    let object: RivetNetworkPolicy = serde_norway::from_str(&text).unwrap();
    let err = policy_from_object(&object).unwrap_err();
    assert_eq!(
        err.to_string(),
        "spec.ingress[0].ports[0].endPort: must be >= port (5432), found 5000"
    );
}

#[test]
fn network_policy_object_is_the_same_policy_as_its_yaml() {
    let text = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-from-web, namespace: shop}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
  ingress:
  - from:
    - podSelector: {matchLabels: {app: web}}
    - ipBlock: {cidr: 198.18.0.0/15, except: [198.19.0.0/16]}
    ports:
    - {port: 5432}
    - {protocol: UDP, port: dns, endPort: null}
"#;
    let from_file = Policy::parse(text).unwrap();
    let object: NetworkPolicy = serde_norway::from_str(text).unwrap();
    let from_api = policy_from_object(&object).unwrap();
    assert_eq!(from_api.key(), from_file.key());
    assert!(from_api.same_spec(&from_file), "{}", from_api.normalized_json());
}
