//! What Kubernetes says svc-endpoint should know, computed from the watch
//! caches with no I/O: each pod's metadata, each namespace's labels, each
//! policy's document, each Service's and EndpointSlice's document. A feed pass compares it with what was last sent
//! ([`Desired::changes_from`]) or sends it whole (a replay).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::DynamicObject;
use rivet_common::labels::{Label, LabelSource};
use rivet_proto::endpoint::v1 as pb;
use serde_json::json;

/// A pod by namespace and name.
pub type PodKey = (String, String);

/// A policy by kind, namespace and name (the repository's key).
pub type PolicyKey = (String, String, String);

/// A Service or EndpointSlice by kind, namespace and name (the catalog's
/// key; Services sort before EndpointSlices).
pub type ServiceObjectKey = (pb::ServiceObjectKind, String, String);

/// The label that ties an EndpointSlice to its Service; slices without it
/// are not managed for a Service and are not fed.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The whole state svc-endpoint gets from Kubernetes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    /// This node's pods.
    pub pods: BTreeMap<PodKey, pb::PodMetadata>,
    /// Every namespace's labels as `k8s:key=value`, sorted.
    pub namespaces: BTreeMap<String, Vec<String>>,
    /// NetworkPolicies and RivetNetworkPolicies as JSON documents.
    pub policies: BTreeMap<PolicyKey, String>,
    /// Services and the EndpointSlices managed for them, as JSON documents.
    pub service_objects: BTreeMap<ServiceObjectKey, String>,
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
    /// ApplyServiceObject with origin KUBERNETES.
    ApplyServiceObject(ServiceObjectKey, String),
    /// DeleteServiceObject with origin KUBERNETES.
    DeleteServiceObject(ServiceObjectKey),
}

impl Desired {
    /// The calls that turn `sent` (what svc-endpoint was last told) into
    /// `self`: namespaces first (a pod's identity needs its namespace's
    /// labels), then pods, then policies; deletions after upserts of the
    /// same kind. Then service objects: Services that went are deleted
    /// first (a new Service may take a deleted one's clusterIP), then
    /// Services applied, then EndpointSlices applied, then slices that went
    /// deleted (a replaced slice's backends never all vanish at once).
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
        let is_service = |key: &&ServiceObjectKey| key.0 == pb::ServiceObjectKind::Service;
        let gone = sent
            .service_objects
            .keys()
            .filter(|k| !self.service_objects.contains_key(*k));
        changes.extend(
            gone.clone()
                .filter(is_service)
                .cloned()
                .map(Change::DeleteServiceObject),
        );
        // Sorted by kind: Services before EndpointSlices.
        for (key, document) in &self.service_objects {
            if sent.service_objects.get(key) != Some(document) {
                changes.push(Change::ApplyServiceObject(key.clone(), document.clone()));
            }
        }
        changes.extend(
            gone.filter(|k| !is_service(k))
                .cloned()
                .map(Change::DeleteServiceObject),
        );
        changes
    }

    /// This as sent by a replay that refused `rejected`: the service
    /// objects refused for a reason that may pass once other objects change
    /// (CLUSTER_IP_UNAVAILABLE, as `FeedError::is_retried_on_poll`) are
    /// left out, so the next pass sends them again; other refusals are kept
    /// as sent (tried again when the object changes).
    pub fn without_retried_refusals(mut self, rejected: &[pb::ReplayItemError]) -> Self {
        for item in rejected {
            if item.reason() == pb::ErrorReason::ClusterIpUnavailable
                && let Some(key) = &item.service_object
            {
                self.service_objects
                    .remove(&(key.kind(), key.namespace.clone(), key.name.clone()));
            }
        }
        self
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
            Change::ApplyServiceObject(key, document) => {
                self.service_objects.insert(key.clone(), document.clone());
            }
            Change::DeleteServiceObject(key) => {
                self.service_objects.remove(key);
            }
        }
    }

    /// The whole state as one ReplayKubernetes stream: namespaces, pods,
    /// policies, Services, EndpointSlices, then `end`.
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
        let service_objects = self.service_objects.values().cloned().map(Item::ServiceDocument);
        namespaces
            .chain(pods)
            .chain(policies)
            .chain(service_objects)
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

/// A Service as the document svc-endpoint's catalog parses: apiVersion,
/// kind, name, namespace, labels and spec (no status, no resourceVersion:
/// a status or metadata write is no change of the document).
pub fn service_document(service: &Service) -> Option<(ServiceObjectKey, String)> {
    let namespace = service.metadata.namespace.clone()?;
    let name = service.metadata.name.clone()?;
    let document = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "namespace": namespace, "name": name, "labels": service.metadata.labels },
        "spec": service.spec,
    });
    Some(((pb::ServiceObjectKind::Service, namespace, name), document.to_string()))
}

/// An EndpointSlice managed for a Service (label
/// `kubernetes.io/service-name`) as the document the catalog parses, with
/// its endpoints' conditions; `None` for a slice of no Service.
pub fn endpoint_slice_document(slice: &EndpointSlice) -> Option<(ServiceObjectKey, String)> {
    let namespace = slice.metadata.namespace.clone()?;
    let name = slice.metadata.name.clone()?;
    let labels = slice.metadata.labels.as_ref()?;
    labels.get(SERVICE_NAME_LABEL).filter(|s| !s.is_empty())?;
    let document = json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": { "namespace": namespace, "name": name, "labels": labels },
        "addressType": slice.address_type,
        "endpoints": slice.endpoints,
        "ports": slice.ports,
    });
    Some((
        (pb::ServiceObjectKind::EndpointSlice, namespace, name),
        document.to_string(),
    ))
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
    fn service_documents_keep_spec_and_labels_and_ignore_status_and_resource_version() {
        let mut service: Service = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "shop", "name": "web", "resourceVersion": "3", "uid": "u",
                         "labels": {"team": "a"}},
            "spec": {"clusterIP": "198.19.128.10", "selector": {"app": "web"},
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
                     "sessionAffinity": "ClientIP"},
            "status": {"loadBalancer": {}}
        }))
        .unwrap();
        let (key, first) = service_document(&service).unwrap();
        assert_eq!(key, (pb::ServiceObjectKind::Service, "shop".into(), "web".into()));
        service.metadata.resource_version = Some("4".into());
        service.status = None;
        assert_eq!(service_document(&service).unwrap().1, first);
        let value: serde_json::Value = serde_json::from_str(&first).unwrap();
        assert_eq!(value["kind"], "Service");
        assert_eq!(
            value["metadata"],
            json!({"namespace": "shop", "name": "web", "labels": {"team": "a"}})
        );
        assert_eq!(value["spec"]["ports"][0]["targetPort"], 8080);
        assert_eq!(value["spec"]["sessionAffinity"], "ClientIP");
        assert!(value.get("status").is_none());
    }

    #[test]
    fn endpoint_slices_carry_conditions_and_only_those_of_a_service_are_fed() {
        let mut slice: EndpointSlice = serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "shop", "name": "web-abc", "resourceVersion": "9",
                         "labels": {"kubernetes.io/service-name": "web",
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["198.18.0.10"], "nodeName": "node-1",
                 "conditions": {"ready": false, "serving": true, "terminating": true},
                 "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-1"}}
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
        }))
        .unwrap();
        let (key, document) = endpoint_slice_document(&slice).unwrap();
        assert_eq!(
            key,
            (pb::ServiceObjectKind::EndpointSlice, "shop".into(), "web-abc".into())
        );
        let value: serde_json::Value = serde_json::from_str(&document).unwrap();
        assert_eq!(value["addressType"], "IPv4");
        assert_eq!(value["metadata"]["labels"][SERVICE_NAME_LABEL], "web");
        assert_eq!(
            value["endpoints"][0]["conditions"],
            json!({"ready": false, "serving": true, "terminating": true})
        );
        assert_eq!(value["endpoints"][0]["targetRef"]["name"], "web-1");
        assert_eq!(value["ports"][0]["port"], 8080);
        assert!(value["metadata"].get("resourceVersion").is_none());

        slice.metadata.labels.as_mut().unwrap().remove(SERVICE_NAME_LABEL);
        assert_eq!(endpoint_slice_document(&slice), None, "a slice of no Service");
    }

    #[test]
    fn service_changes_delete_services_first_and_slices_last() {
        let key = |kind, name: &str| (kind, "shop".to_string(), name.to_string());
        let (service, slice) = (pb::ServiceObjectKind::Service, pb::ServiceObjectKind::EndpointSlice);
        let mut sent = Desired::default();
        sent.service_objects.insert(key(service, "old"), "old".into());
        sent.service_objects.insert(key(slice, "old-1"), "old-1".into());
        sent.service_objects.insert(key(service, "web"), "web v1".into());
        let mut desired = Desired::default();
        desired.service_objects.insert(key(slice, "new-1"), "new-1".into());
        desired.service_objects.insert(key(service, "new"), "new".into());
        desired.service_objects.insert(key(service, "web"), "web v1".into());
        let changes = desired.changes_from(&sent);
        assert_eq!(
            changes,
            vec![
                Change::DeleteServiceObject(key(service, "old")),
                Change::ApplyServiceObject(key(service, "new"), "new".into()),
                Change::ApplyServiceObject(key(slice, "new-1"), "new-1".into()),
                Change::DeleteServiceObject(key(slice, "old-1")),
            ]
        );
        for change in &changes {
            sent.apply(change);
        }
        assert_eq!(sent, desired);
        let items = desired.replay_items();
        let documents: Vec<_> = items
            .iter()
            .filter_map(|i| match &i.item {
                Some(pb::replay_kubernetes_request::Item::ServiceDocument(d)) => Some(d.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(documents, ["new", "web v1", "new-1"], "Services, then slices");
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
