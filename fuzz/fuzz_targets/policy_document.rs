//! Policy documents (NetworkPolicy, RivetNetworkPolicy; YAML and JSON)
//! through rivet-policy's parser and compiler, and the compiled policy
//! through svc-loader's request validation.
//!
//! Input: a document or a multi-document stream.

#![no_main]

use std::net::IpAddr;

use libfuzzer_sys::fuzz_target;
use rivet_common::identity::CIDR_IDENTITY_MIN;
use rivet_common::labels::Labels;
use rivet_policy::{Policy, PolicyOrigin, PolicyRepository, SelectorCache, Subject};
use rivet_proto::loader::v1 as loader;
use rivet_proto::net::address_bytes;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(policies) = Policy::parse_all(text) {
        for policy in &policies {
            compile(policy);
        }
    }
    let Ok(policy) = Policy::parse(text) else {
        return;
    };
    // Parsing is a function of the text.
    let again = Policy::parse(text).expect("parses twice");
    assert!(policy.same_spec(&again));
    let normalized: serde_json::Value =
        serde_json::from_str(&policy.normalized_json()).expect("normalized_json is JSON");
    assert_eq!(normalized["metadata"]["name"], policy.key().name.as_str());
    // YAML and JSON are one format: the same data as JSON is the same policy.
    if let Ok(value) = serde_norway::from_str::<serde_json::Value>(text) {
        let json = value.to_string();
        match Policy::parse(&json) {
            Ok(from_json) => assert!(
                policy.same_spec(&from_json),
                "as JSON a different policy:\n{}\n{}",
                policy.normalized_json(),
                from_json.normalized_json()
            ),
            Err(e) => panic!("parses as YAML but not as the same data in JSON ({e}):\n{json}"),
        }
    }
});

/// Labels of the identities the compiler sees: pods of the policy's
/// namespace and of another, with and without labels a selector may name.
const PODS: &[&str] = &[
    "k8s:app=web",
    "k8s:app=db,k8s:tier=backend",
    "k8s:app=web,k8s:role=admin,container:x=y",
    "",
];

/// Compiles the policy for a few endpoints and has svc-loader's
/// ApplyEndpoint validation check the result: every entry the engine
/// produces must be one the loader accepts (the crate's promise).
fn compile(policy: &Policy) {
    let namespace = policy.key().namespace.clone();
    let mut cache = SelectorCache::new();
    let mut subjects = Vec::new();
    for (i, pod) in PODS.iter().enumerate() {
        let labels: Labels = pod.parse().expect("fixture labels");
        for (j, ns) in [namespace.as_str(), "other"].into_iter().enumerate() {
            let Ok(identity) = labels.with_namespace(ns, [("kubernetes.io/metadata.name", ns), ("team", "a")]) else {
                continue;
            };
            let id = 256 + (i * 2 + j) as u32;
            cache.upsert_identity(id, identity.clone());
            subjects.push(identity);
        }
    }
    for (i, prefix) in policy.cidrs().into_iter().enumerate() {
        cache.set_cidr_identity(prefix, CIDR_IDENTITY_MIN + i as u32);
    }
    let mut repository = PolicyRepository::new();
    repository
        .upsert(policy.clone(), PolicyOrigin::Api)
        .expect("a first upsert of a parsed policy");
    let offset = policy.cidrs().len() as u32;
    for (i, host) in repository.named_port_hosts(&cache).into_iter().enumerate() {
        cache.set_cidr_identity(host, CIDR_IDENTITY_MIN + offset + i as u32);
    }
    for labels in &subjects {
        let resolved = repository.resolve(&Subject::new(labels), &cache);
        let request = loader::ApplyEndpointRequest {
            endpoint_id: 1,
            host_ifindex: 2,
            addresses: vec![address_bytes(IpAddr::from([198, 18, 0, 1]))],
            mac: vec![2, 0, 0, 0, 0, 1],
            identity: 256,
            policy: Some(resolved.to_proto(1, true)),
        };
        if let Err(e) = svc_loader::validate::endpoint(&request) {
            panic!(
                "svc-loader refuses the compiled policy of {labels}: {e}\n{}",
                policy.normalized_json()
            );
        }
    }
}
