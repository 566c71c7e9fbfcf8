//! The labels an endpoint's identity is derived from: its pod's labels
//! (also remembered for a pod without an endpoint yet) and its namespace's.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use rivet_common::labels::{Label, LabelSource, Labels, ReservedIdentity};
use tonic::Status;

use super::{EndpointManager, EndpointSelector, EndpointView, ManagerError, State, store};
use crate::endpoint::{EndpointKind, EndpointSpec, EndpointState};

/// The namespace of endpoints created without one.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The namespace label Kubernetes sets on every namespace; added here too so
/// `namespaceSelector` can name a namespace.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// A namespace with labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NamespaceLabels {
    /// Label key → value (no source).
    pub labels: BTreeMap<String, String>,
    /// Last change.
    pub updated: Option<SystemTime>,
}

impl State {
    /// The full label set an endpoint's identity is allocated for.
    pub(super) fn identity_request_labels(&self, spec: &EndpointSpec) -> Result<Labels, Status> {
        if spec.kind == EndpointKind::Health {
            // Not a pod: no pod or namespace selector may select it.
            return Ok(ReservedIdentity::Health.labels());
        }
        if spec.labels_pending {
            // Kubernetes mode, the pod's labels not known yet.
            return Ok(ReservedIdentity::Init.labels());
        }
        let namespace = self.namespaces.get(&spec.pod_namespace);
        let mut ns_labels: BTreeMap<&str, &str> = namespace
            .map(|n| n.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect())
            .unwrap_or_default();
        ns_labels.insert(NAMESPACE_NAME_LABEL, &spec.pod_namespace);
        spec.labels
            .with_namespace(&spec.pod_namespace, ns_labels)
            .map_err(|e| Status::invalid_argument(format!("labels of namespace {}: {e}", spec.pod_namespace)))
    }
}

impl EndpointManager {
    /// Replaces the pod labels of the selected endpoints (a pod selector
    /// with no endpoint remembers them for its create). Returns the
    /// endpoints after the change and how many were re-identified.
    pub async fn update_labels(
        &self,
        selector: &EndpointSelector,
        labels: Labels,
        wait: bool,
        deadline: Duration,
    ) -> Result<(Vec<EndpointView>, usize), ManagerError> {
        if self.kubernetes_mode() {
            return Err(ManagerError::LabelsFromKubernetes);
        }
        let waits = {
            let mut state = self.state();
            let ids = state.find(selector);
            if ids.is_empty() {
                match selector {
                    EndpointSelector::Pod { namespace, name } => {
                        state.pod_labels.insert((namespace.clone(), name.clone()), labels);
                        return Ok((Vec::new(), 0));
                    }
                    _ => {
                        return Err(ManagerError::NotFound {
                            selector: selector.clone(),
                        });
                    }
                }
            }
            if let EndpointSelector::Pod { namespace, name } = selector {
                state
                    .pod_labels
                    .insert((namespace.clone(), name.clone()), labels.clone());
            }
            let mut waits = Vec::new();
            for id in ids {
                let slot = state.endpoints.get_mut(&id).expect("found above");
                if slot.spec.labels == labels || slot.queue.is_closed() {
                    continue;
                }
                slot.spec.labels = labels.clone();
                slot.status.traceparent = rivet_common::telemetry::current_traceparent();
                slot.status
                    .transition(id, EndpointState::WaitingToRegenerate, "labels changed");
                let wait = (
                    id,
                    slot.queue.clone(),
                    slot.status.identity,
                    slot.queue.request("labels changed"),
                );
                state.changed(id);
                waits.push(wait);
            }
            waits
        };
        let mut ids: Vec<u16> = waits.iter().map(|(id, ..)| *id).collect();
        if wait {
            self.wait_all(
                &waits
                    .iter()
                    .map(|(id, q, _, g)| (*id, q.clone(), *g))
                    .collect::<Vec<_>>(),
                deadline,
            )
            .await?;
        }
        let mut reidentified = 0;
        let state = self.state();
        for (id, _, before, _) in &waits {
            if let Some(slot) = state.endpoints.get(id)
                && slot.status.identity != *before
            {
                reidentified += 1;
            }
        }
        if ids.is_empty() {
            ids = state.find(selector);
        }
        let views = ids
            .iter()
            .filter_map(|id| state.endpoints.get(id))
            .map(|s| EndpointView {
                spec: s.spec.clone(),
                status: s.status.clone(),
            })
            .collect();
        Ok((views, reidentified))
    }

    /// Replaces a namespace's labels; its endpoints are re-identified (not
    /// waited for). Returns whether anything changed and how many endpoints
    /// were queued.
    pub async fn set_namespace_labels(
        &self,
        namespace: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<(bool, usize), ManagerError> {
        let (changed, queued) = self
            .replace_namespace_labels(BTreeMap::from([(namespace.to_string(), labels)]))
            .await?;
        Ok((changed > 0, queued.len()))
    }

    /// Replaces the labels of each named namespace (an empty set forgets
    /// it), persisted once; the endpoints of changed namespaces are
    /// re-identified (not waited for). Returns how many namespaces changed
    /// and the endpoints queued. The one path of SetNamespaceLabels and of
    /// a Kubernetes replay.
    pub(super) async fn replace_namespace_labels(
        &self,
        changes: BTreeMap<String, BTreeMap<String, String>>,
    ) -> Result<(usize, Vec<u16>), ManagerError> {
        let _config = self.inner.config_lock.lock().await;
        let (mut next, changed) = {
            let state = self.state();
            let changed: Vec<(String, BTreeMap<String, String>)> = changes
                .into_iter()
                .filter(|(namespace, labels)| {
                    let current = state.namespaces.get(namespace).map(|n| &n.labels);
                    !(current == Some(labels) || (current.is_none() && labels.is_empty()))
                })
                .collect();
            if changed.is_empty() {
                return Ok((0, Vec::new()));
            }
            (state.namespaces.clone(), changed)
        };
        for (namespace, labels) in &changed {
            if labels.is_empty() {
                next.remove(namespace);
            } else {
                next.insert(
                    namespace.clone(),
                    NamespaceLabels {
                        labels: labels.clone(),
                        updated: Some(SystemTime::now()),
                    },
                );
            }
        }
        // Durable before it takes effect; written off the runtime's threads
        // and without the state lock (an fsync stalls every regeneration).
        store(&self.inner.namespaces_file, next.clone(), "namespace labels").await?;
        let mut state = self.state();
        state.namespaces = next;
        let mut queued = Vec::new();
        for slot in state.endpoints.values_mut() {
            // An endpoint on the init identity has no namespace labels.
            if changed
                .iter()
                .any(|(namespace, _)| slot.spec.pod_namespace == *namespace)
                && !slot.queue.is_closed()
                && !slot.spec.labels_pending
            {
                slot.queue.request("namespace labels changed");
                queued.push(slot.spec.id);
            }
        }
        Ok((changed.len(), queued))
    }

    /// Namespaces with labels or endpoints: (name, labels, endpoints).
    pub fn namespaces(&self) -> Vec<(String, NamespaceLabels, usize)> {
        let state = self.state();
        let mut out: BTreeMap<String, (NamespaceLabels, usize)> = state
            .namespaces
            .iter()
            .map(|(name, labels)| (name.clone(), (labels.clone(), 0)))
            .collect();
        for slot in state.endpoints.values() {
            out.entry(slot.spec.pod_namespace.clone()).or_default().1 += 1;
        }
        out.into_iter().map(|(name, (labels, n))| (name, labels, n)).collect()
    }
}

/// Parses a `k8s:key=value` namespace label.
pub fn parse_namespace_label(text: &str) -> Result<(String, String), String> {
    let label: Label = text.parse().map_err(|e| format!("{text:?}: {e}"))?;
    if label.source() != LabelSource::K8s {
        return Err(format!("{text:?}: namespace labels must have source k8s"));
    }
    Ok((label.key().to_string(), label.value().to_string()))
}
