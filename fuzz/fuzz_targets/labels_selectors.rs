//! Labels, label sets and label filters (rivet-common), and label selectors
//! (rivet-policy, through a policy's podSelector).
//!
//! Input: text. Its first line is tried as a label, a label list and
//! filter rules; with a second line (a JSON label selector) the selector's
//! decision for the first line's labels is checked against an independent
//! reading of Kubernetes' selector rules.

#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use rivet_common::labels::{Label, LabelFilter, LabelSource, Labels};
use rivet_policy::Policy;
use serde_json::{Value, json};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (first, rest) = text.split_once('\n').unwrap_or((text, ""));
    check_label(first);
    let labels = check_labels(first);
    check_filter(first, labels.as_ref());
    if let (Some(labels), Ok(selector)) = (labels, serde_json::from_str::<Value>(rest)) {
        check_selector(&labels, &selector);
    }
});

/// A label that parses prints in a form that parses back to itself.
fn check_label(text: &str) {
    if let Ok(label) = text.parse::<Label>() {
        let printed = label.to_string();
        let again: Label = printed
            .parse()
            .unwrap_or_else(|e| panic!("{text:?} printed as {printed:?}, which does not parse: {e}"));
        assert_eq!(again, label, "{text:?} -> {printed:?}");
        assert_eq!(
            Label::new(label.source(), label.key(), label.value()).as_ref(),
            Ok(&label)
        );
    }
}

/// A label set that parses prints and serialises back to itself.
fn check_labels(text: &str) -> Option<Labels> {
    let labels = text.parse::<Labels>().ok()?;
    let printed = labels.to_string();
    let again: Labels = printed
        .parse()
        .unwrap_or_else(|e| panic!("{text:?} printed as {printed:?}, which does not parse: {e}"));
    assert_eq!(again, labels, "{text:?} -> {printed:?}");
    let json = serde_json::to_string(&labels).expect("labels serialise");
    let back: Labels = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{json}: {e}"));
    assert_eq!(back, labels);
    // One value per source and key.
    let mut keys = std::collections::BTreeSet::new();
    assert!(labels.iter().all(|l| keys.insert((l.source(), l.key().to_string()))));
    Some(labels)
}

/// Filter rules that parse print back to the same filter, and filtering
/// only removes labels, never reserved or cidr ones, and is idempotent.
fn check_filter(text: &str, labels: Option<&Labels>) {
    let rules: Vec<&str> = text.split(',').collect();
    let Ok(filter) = LabelFilter::from_rules(&rules) else {
        return;
    };
    let printed = filter.to_string();
    let again = LabelFilter::from_rules(printed.split(',').filter(|r| !r.is_empty()))
        .unwrap_or_else(|e| panic!("{text:?} printed as {printed:?}, which does not parse: {e}"));
    assert_eq!(again, filter, "{text:?} -> {printed:?}");
    let _ = LabelFilter::parse(&rules).expect("the defaults plus rules that parse alone");
    if let Some(labels) = labels {
        let kept = filter.filter(labels);
        assert!(kept.iter().all(|l| labels.contains(l)));
        assert!(
            labels
                .iter()
                .filter(|l| matches!(l.source(), LabelSource::Reserved | LabelSource::Cidr))
                .all(|l| kept.contains(l)),
            "reserved and cidr labels are never filtered"
        );
        assert_eq!(filter.filter(&kept), kept);
    }
}

/// A podSelector that parses decides as Kubernetes says: every matchLabels
/// pair and matchExpressions requirement holds for the pod's labels of
/// source k8s, container or unspec (the namespace keys are the
/// namespace's, never the pod's).
fn check_selector(labels: &Labels, selector: &Value) {
    let document = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "fuzz", "namespace": "fuzz"},
        "spec": {"podSelector": selector},
    });
    let Ok(policy) = Policy::parse(&document.to_string()) else {
        return;
    };
    let Ok(subject) = labels.with_namespace("fuzz", [("kubernetes.io/metadata.name", "fuzz")]) else {
        return;
    };
    let expected = oracle(selector, &subject);
    assert_eq!(
        policy.selects(&subject),
        expected,
        "selector {selector} on {subject} (the oracle says {expected})"
    );
}

fn oracle(selector: &Value, labels: &Labels) -> bool {
    let mut pod: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for label in labels {
        let namespace_key = label.key() == "io.kubernetes.pod.namespace" || label.key().starts_with("ns.labels/");
        let pod_source = matches!(
            label.source(),
            LabelSource::K8s | LabelSource::Container | LabelSource::Unspec
        );
        if pod_source && !namespace_key {
            pod.entry(label.key()).or_default().push(label.value());
        }
    }
    let values = |key: &str| pod.get(key).cloned().unwrap_or_default();
    let match_labels = selector.get("matchLabels").and_then(Value::as_object);
    let labels_hold = match_labels.is_none_or(|m| {
        m.iter()
            .all(|(k, v)| v.as_str().is_some_and(|v| values(k).contains(&v)))
    });
    let expressions = selector
        .get("matchExpressions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let expressions_hold = expressions.iter().all(|e| {
        let key = e["key"].as_str().unwrap_or_default();
        let listed: Vec<&str> = e
            .get("values")
            .and_then(Value::as_array)
            .map(|vs| vs.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let have = values(key);
        match e["operator"].as_str().unwrap_or_default() {
            "In" => have.iter().any(|v| listed.contains(v)),
            "NotIn" => !have.iter().any(|v| listed.contains(v)),
            "Exists" => !have.is_empty(),
            "DoesNotExist" => have.is_empty(),
            other => panic!("the parser accepted operator {other:?}"),
        }
    });
    labels_hold && expressions_hold
}
