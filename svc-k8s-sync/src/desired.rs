//! What Kubernetes says svc-endpoint should know, computed from the watch
//! caches with no I/O: each pod's metadata, each namespace's labels, each
//! policy's document. A feed pass compares it with what was last sent
//! ([`Desired::changes_from`]) or sends it whole (a replay).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::DynamicObject;
use rivet_common::labels::{Label, LabelSource};
use rivet_proto::endpoint::v1 as pb;
use serde_json::json;

/// A pod by namespace and name.
pub type PodKey = (String, String);

/// A policy by kind, namespace and name (the repository's key).
pub type PolicyKey = (String, String, String);

/// The whole state svc-endpoint gets from Kubernetes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    /// This node's pods.
    pub pods: BTreeMap<PodKey, pb::PodMetadata>,
    /// Every namespace's labels as `k8s:key=value`, sorted.
    pub namespaces: BTreeMap<String, Vec<String>>,
    /// NetworkPolicies and RivetNetworkPolicies as JSON documents.
    pub policies: BTreeMap<PolicyKey, String>,
}

/// One call that brings svc-endpoint from one state to another.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// SetPodMetadata.
    SetPod(pb::PodMetadata),
    /// DeletePodMetadata.
    DeletePod(PodKey),
    /// SetNamespaceLabels (an empty set forgets the namespace).
    SetNamespace(String, Vec<String>),
    /// UpsertPolicy with origin KUBERNETES.
    UpsertPolicy(PolicyKey, String),
    /// DeletePolicy with origin KUBERNETES.
    DeletePolicy(PolicyKey),
}

impl Desired {
    /// The calls that turn `sent` (what svc-endpoint was last told) into
    /// `self`: namespaces first (a pod's identity needs its namespace's
    /// labels), then pods, then policies; deletions after upserts of the
    /// same kind.
    pub fn changes_from(&self, sent: &Desired) -> Vec<Change> {
        let mut changes = Vec::new();
        for (name, labels) in &self.namespaces {
            if sent.namespaces.get(name) != Some(labels) {
                changes.push(Change::SetNamespace(name.clone(), labels.clone()));
            }
        }
        for name in sent.namespaces.keys().filter(|n| !self.namespaces.contains_key(*n)) {
            changes.push(Change::SetNamespace(name.clone(), Vec::new()));
        }
        for (key, metadata) in &self.pods {
            if sent.pods.get(key) != Some(metadata) {
                changes.push(Change::SetPod(metadata.clone()));
            }
        }
        for key in sent.pods.keys().filter(|k| !self.pods.contains_key(*k)) {
            changes.push(Change::DeletePod(key.clone()));
        }
        for (key, document) in &self.policies {
            if sent.policies.get(key) != Some(document) {
                changes.push(Change::UpsertPolicy(key.clone(), document.clone()));
            }
        }
        for key in sent.policies.keys().filter(|k| !self.policies.contains_key(*k)) {
            changes.push(Change::DeletePolicy(key.clone()));
        }
        changes
    }

    /// Records that `change` was applied to this (the sent state).
    pub fn apply(&mut self, change: &Change) {
        match change {
            Change::SetPod(metadata) => {
                self.pods.insert(pod_key_of(metadata), metadata.clone());
            }
            Change::DeletePod(key) => {
                self.pods.remove(key);
            }
            Change::SetNamespace(name, labels) if labels.is_empty() => {
                self.namespaces.remove(name);
            }
            Change::SetNamespace(name, labels) => {
                self.namespaces.insert(name.clone(), labels.clone());
            }
            Change::UpsertPolicy(key, document) => {
                self.policies.insert(key.clone(), document.clone());
            }
            Change::DeletePolicy(key) => {
                self.policies.remove(key);
            }
        }
    }

    /// The whole state as one ReplayKubernetes stream: namespaces, pods,
    /// policies, then `end`.
    pub fn replay_items(&self) -> Vec<pb::ReplayKubernetesRequest> {
        use pb::replay_kubernetes_request::Item;
        let namespaces = self.namespaces.iter().map(|(name, labels)| {
            Item::Namespace(pb::SetNamespaceLabelsRequest {
                namespace: name.clone(),
                labels: labels.clone(),
            })
        });
        let pods = self.pods.values().cloned().map(Item::Pod);
        let policies = self.policies.values().cloned().map(Item::PolicyDocument);
        namespaces
            .chain(pods)
            .chain(policies)
            .chain(std::iter::once(Item::End(true)))
            .map(|item| pb::ReplayKubernetesRequest { item: Some(item) })
            .collect()
    }
}

fn pod_key_of(metadata: &pb::PodMetadata) -> PodKey {
    let pod = metadata.pod.clone().unwrap_or_default();
    (pod.namespace, pod.name)
}

/// `k8s:key=value` for each label; labels Rivet cannot represent are left
/// out (the API server validates label syntax, so none is expected).
pub fn k8s_labels(labels: Option<&BTreeMap<String, String>>) -> Vec<String> {
    let mut out: Vec<String> = labels
        .into_iter()
        .flatten()
        .filter_map(|(key, value)| Label::new(LabelSource::K8s, key.as_str(), value.as_str()).ok())
        .map(|label| label.to_string())
        .collect();
    out.sort();
    out
}

/// A pod's metadata for svc-endpoint: its labels, uid and named container
/// ports (`spec.containers[].ports[]` with a name; init containers' ports
/// serve no traffic and are left out). `None` for a pod without namespace
/// or name.
pub fn pod_metadata(pod: &Pod) -> Option<pb::PodMetadata> {
    let namespace = pod.metadata.namespace.clone()?;
    let name = pod.metadata.name.clone()?;
    let mut named_ports: Vec<pb::NamedPort> = pod
        .spec
        .iter()
        .flat_map(|spec| spec.containers.iter())
        .flat_map(|container| container.ports.iter().flatten())
        .filter_map(|port| {
            let name = port.name.clone()?;
            let port_number = u32::try_from(port.container_port).ok()?;
            Some(pb::NamedPort {
                name,
                protocol: port.protocol.clone().unwrap_or_else(|| "TCP".into()),
                port: port_number,
            })
        })
        .collect();
    named_ports.sort_by(|a, b| (&a.name, &a.protocol, a.port).cmp(&(&b.name, &b.protocol, b.port)));
    named_ports.dedup();
    Some(pb::PodMetadata {
        pod: Some(pb::PodRef { namespace, name }),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        labels: k8s_labels(pod.metadata.labels.as_ref()),
        named_ports,
    })
}

/// A namespace's name and labels.
pub fn namespace_labels(namespace: &Namespace) -> Option<(String, Vec<String>)> {
    let name = namespace.metadata.name.clone()?;
    Some((name, k8s_labels(namespace.metadata.labels.as_ref())))
}

/// A NetworkPolicy as the document svc-endpoint's repository parses: only
/// apiVersion, kind, name, namespace and spec, so a change of
/// resourceVersion or status is no change of the document.
pub fn network_policy_document(policy: &NetworkPolicy) -> Option<(PolicyKey, String)> {
    let namespace = policy.metadata.namespace.clone()?;
    let name = policy.metadata.name.clone()?;
    let document = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": { "namespace": namespace, "name": name },
        "spec": policy.spec,
    });
    Some((("NetworkPolicy".into(), namespace, name), document.to_string()))
}

/// A RivetNetworkPolicy (read as a dynamic object: its spec is passed on
/// as the API holds it) as the document the repository parses.
pub fn rivet_policy_document(policy: &DynamicObject) -> Option<(PolicyKey, String)> {
    let namespace = policy.metadata.namespace.clone()?;
    let name = policy.metadata.name.clone()?;
    let document = json!({
        "apiVersion": crate::RIVET_API_VERSION,
        "kind": "RivetNetworkPolicy",
        "metadata": { "namespace": namespace, "name": name },
        "spec": policy.data.get("spec").cloned().unwrap_or_else(|| json!({})),
    });
    Some((("RivetNetworkPolicy".into(), namespace, name), document.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, ContainerPort, PodSpec};
    use kube::api::ObjectMeta;

    fn pod(name: &str, labels: &[(&str, &str)]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some("shop".into()),
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "main".into(),
                    ports: Some(vec![
                        ContainerPort {
                            name: Some("http".into()),
                            container_port: 8080,
                            ..Default::default()
                        },
                        ContainerPort {
                            container_port: 9090,
                            ..Default::default()
                        },
                        ContainerPort {
                            name: Some("dns".into()),
                            container_port: 53,
                            protocol: Some("UDP".into()),
                            ..Default::default()
                        },
                    ]),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn pod_metadata_has_k8s_labels_and_only_named_ports() {
        let metadata = pod_metadata(&pod("web-1", &[("app", "web"), ("tier", "front")])).unwrap();
        assert_eq!(metadata.labels, vec!["k8s:app=web", "k8s:tier=front"]);
        assert_eq!(metadata.uid, "uid-web-1");
        let ports: Vec<_> = metadata
            .named_ports
            .iter()
            .map(|p| (p.name.as_str(), p.protocol.as_str(), p.port))
            .collect();
        assert_eq!(ports, vec![("dns", "UDP", 53), ("http", "TCP", 8080)]);
    }

    #[test]
    fn changes_order_namespaces_pods_policies_and_delete_what_went() {
        let mut sent = Desired::default();
        sent.namespaces.insert("old".into(), vec!["k8s:a=b".into()]);
        sent.pods
            .insert(("shop".into(), "gone".into()), pod_metadata(&pod("gone", &[])).unwrap());
        sent.policies
            .insert(("NetworkPolicy".into(), "shop".into(), "p".into()), "{}".into());
        let mut desired = Desired::default();
        desired.namespaces.insert("shop".into(), vec!["k8s:team=a".into()]);
        let web = pod_metadata(&pod("web", &[("app", "web")])).unwrap();
        desired.pods.insert(("shop".into(), "web".into()), web.clone());
        let changes = desired.changes_from(&sent);
        assert_eq!(
            changes,
            vec![
                Change::SetNamespace("shop".into(), vec!["k8s:team=a".into()]),
                Change::SetNamespace("old".into(), vec![]),
                Change::SetPod(web),
                Change::DeletePod(("shop".into(), "gone".into())),
                Change::DeletePolicy(("NetworkPolicy".into(), "shop".into(), "p".into())),
            ]
        );
        for change in &changes {
            sent.apply(change);
        }
        assert_eq!(sent, desired);
        assert!(
            desired.changes_from(&sent).is_empty(),
            "applied changes leave nothing to send"
        );
    }

    #[test]
    fn policy_documents_ignore_resource_version_and_parse_as_policies() {
        let mut policy: NetworkPolicy = serde_json::from_value(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": "shop", "name": "deny", "resourceVersion": "7", "uid": "u"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]}
        }))
        .unwrap();
        let (key, first) = network_policy_document(&policy).unwrap();
        assert_eq!(key, ("NetworkPolicy".into(), "shop".into(), "deny".into()));
        policy.metadata.resource_version = Some("8".into());
        assert_eq!(network_policy_document(&policy).unwrap().1, first);
        let value: serde_json::Value = serde_json::from_str(&first).unwrap();
        assert_eq!(value["spec"]["podSelector"]["matchLabels"]["app"], "web");
        assert_eq!(value["metadata"], json!({"namespace": "shop", "name": "deny"}));
    }

    #[test]
    fn replay_ends_with_end() {
        let mut desired = Desired::default();
        desired.namespaces.insert("shop".into(), vec![]);
        let items = desired.replay_items();
        assert_eq!(items.len(), 2);
        assert_eq!(
            items.last().unwrap().item,
            Some(pb::replay_kubernetes_request::Item::End(true))
        );
    }
}
