//! Kubernetes mode (`--k8s-sync-socket`): pod metadata from svc-k8s-sync
//! (PodMetadataService) and its level-triggered replay.
//!
//! In this mode a pod's labels and named ports come only from here; those
//! of the CNI call are ignored (an endpoint without a pod reference, which
//! no feed will ever describe, keeps the CNI's). A pod created before its
//! metadata arrived gets the reserved `init` identity
//! ([`EndpointSpec::labels_pending`]) and is re-identified when it
//! arrives; the CNI call never fails for it. A replay (after svc-k8s-sync
//! re-listed, or saw a new boot id of ours) names everything Kubernetes
//! holds; what it does not name is forgotten, and only endpoints whose
//! inputs changed are regenerated.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use rivet_common::labels::Labels;
use rivet_policy::{NamedPort, Policy, PolicyOrigin};

use super::queue::Queue;
use super::{EndpointManager, EndpointSelector, ManagerError, State};
use crate::endpoint::{EndpointSpec, EndpointState};
use crate::events;

/// A pod's `namespace/name`.
pub type PodName = (String, String);

/// What Kubernetes says about one pod of this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodMetadata {
    /// `metadata.uid`; empty when unknown.
    pub uid: String,
    /// `metadata.labels`, as `k8s:key=value`.
    pub labels: Labels,
    /// Named container ports.
    pub named_ports: Vec<NamedPort>,
}

impl PodMetadata {
    /// Whether it describes the pod of an endpoint (a pod deleted and
    /// created again under its name has another uid).
    pub(super) fn describes(&self, spec: &EndpointSpec) -> bool {
        self.uid.is_empty() || spec.pod_uid.is_empty() || self.uid == spec.pod_uid
    }

    /// Sets an endpoint's labels and ports from it; whether they changed
    /// (or the endpoint was waiting for them).
    pub(super) fn apply_to(&self, spec: &mut EndpointSpec) -> bool {
        let changed = spec.labels_pending || spec.labels != self.labels || spec.named_ports != self.named_ports;
        spec.labels = self.labels.clone();
        spec.named_ports = self.named_ports.clone();
        spec.labels_pending = false;
        changed
    }
}

/// Everything a replay names, validated (invalid items are reported by the
/// caller and left out).
#[derive(Debug, Default)]
pub struct KubernetesReplay {
    /// Every pod of this node.
    pub pods: BTreeMap<PodName, PodMetadata>,
    /// Every namespace with its labels (key → value).
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    /// Every KUBERNETES policy.
    pub policies: Vec<Policy>,
    /// An item of that kind was rejected: nothing of that kind is forgotten
    /// (the rejected item may have named something held).
    pub rejected_pods: bool,
    /// See [`rejected_pods`](Self::rejected_pods).
    pub rejected_namespaces: bool,
    /// See [`rejected_pods`](Self::rejected_pods).
    pub rejected_policies: bool,
}

/// What a replay changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReplayOutcome {
    /// Pod metadata forgotten (not named).
    pub pods_forgotten: usize,
    /// Namespaces forgotten.
    pub namespaces_forgotten: usize,
    /// KUBERNETES policies removed.
    pub policies_removed: usize,
    /// Endpoints whose inputs changed (re-identified or regenerated).
    pub affected_endpoints: usize,
    /// Policies refused (origin conflict, or the KUBERNETES source is not
    /// enabled): (`Kind namespace/name`, why).
    pub rejected: Vec<(String, String)>,
}

impl State {
    /// Applies the remembered metadata of pod `pod` to its endpoints;
    /// queues a regeneration of those whose labels or ports changed.
    fn apply_pod_metadata(&mut self, pod: &PodName) -> Vec<(u16, Arc<Queue>, u64)> {
        let Some(metadata) = self.pod_metadata.get(pod).cloned() else {
            return Vec::new();
        };
        let ids = self.find(&EndpointSelector::Pod {
            namespace: pod.0.clone(),
            name: pod.1.clone(),
        });
        let mut waits = Vec::new();
        for id in ids {
            let slot = self.endpoints.get_mut(&id).expect("found above");
            if slot.queue.is_closed() || !metadata.describes(&slot.spec) || !metadata.apply_to(&mut slot.spec) {
                continue;
            }
            let reason = "pod metadata changed";
            if slot.status.state != EndpointState::Restoring {
                slot.status.transition(id, EndpointState::WaitingToRegenerate, reason);
            }
            let wait = (id, slot.queue.clone(), slot.queue.request(reason));
            self.changed(id);
            waits.push(wait);
        }
        waits
    }
}

impl EndpointManager {
    /// Whether the node is in Kubernetes mode.
    pub fn kubernetes_mode(&self) -> bool {
        self.inner.deps.pods.is_some()
    }

    fn require_kubernetes(&self) -> Result<(), ManagerError> {
        if self.kubernetes_mode() {
            Ok(())
        } else {
            Err(ManagerError::KubernetesModeOff)
        }
    }

    /// Waits until restore put the state dir's endpoints in the table
    /// (local, quick): metadata applied before would miss them.
    async fn scanned(&self) {
        let _ = self.inner.scanned.subscribe().wait_for(|s| *s).await;
    }

    /// Replaces one pod's metadata; its endpoints whose labels or ports
    /// change are re-identified or regenerated (with `wait`, waited for
    /// within `deadline`). Returns whether the metadata changed and how
    /// many endpoints were queued.
    pub async fn set_pod_metadata(
        &self,
        pod: PodName,
        metadata: PodMetadata,
        wait: bool,
        deadline: Duration,
    ) -> Result<(bool, usize), ManagerError> {
        self.require_kubernetes()?;
        self.scanned().await;
        let (changed, waits) = {
            let mut state = self.state();
            let changed = state.pod_metadata.get(&pod) != Some(&metadata);
            state.pod_metadata.insert(pod.clone(), metadata);
            (changed, state.apply_pod_metadata(&pod))
        };
        if wait {
            self.wait_all(&waits, deadline).await?;
        }
        Ok((changed, waits.len()))
    }

    /// Forgets a pod's metadata (its endpoints keep their labels until the
    /// CNI deletes them); whether it was known.
    pub async fn delete_pod_metadata(&self, pod: &PodName) -> Result<bool, ManagerError> {
        self.require_kubernetes()?;
        Ok(self.state().pod_metadata.remove(pod).is_some())
    }

    /// Applies a complete replay: pod metadata, namespace labels (the
    /// SetNamespaceLabels path) and KUBERNETES policies (the upsert path:
    /// an identical document keeps its revision), then forgets what it did
    /// not name. Regenerates only endpoints whose inputs changed; not
    /// waited for.
    pub async fn replay_kubernetes(&self, replay: KubernetesReplay) -> Result<ReplayOutcome, ManagerError> {
        self.require_kubernetes()?;
        self.scanned().await;
        let mut outcome = ReplayOutcome::default();
        let mut affected = BTreeSet::new();

        // Pods.
        {
            let mut state = self.state();
            let forgotten: Vec<PodName> = if replay.rejected_pods {
                Vec::new()
            } else {
                state
                    .pod_metadata
                    .keys()
                    .filter(|pod| !replay.pods.contains_key(*pod))
                    .cloned()
                    .collect()
            };
            for pod in &forgotten {
                state.pod_metadata.remove(pod);
            }
            outcome.pods_forgotten = forgotten.len();
            for (pod, metadata) in replay.pods {
                state.pod_metadata.insert(pod.clone(), metadata);
                affected.extend(state.apply_pod_metadata(&pod).into_iter().map(|(id, ..)| id));
            }
        }

        // Namespaces.
        let mut namespaces: BTreeMap<String, BTreeMap<String, String>> = replay.namespaces;
        if !replay.rejected_namespaces {
            let held: Vec<String> = self.state().namespaces.keys().cloned().collect();
            for name in held {
                if let std::collections::btree_map::Entry::Vacant(forgotten) = namespaces.entry(name) {
                    forgotten.insert(BTreeMap::new());
                    outcome.namespaces_forgotten += 1;
                }
            }
        }
        let (_, queued) = self.replace_namespace_labels(namespaces).await?;
        affected.extend(queued);

        // Policies.
        let mut named = BTreeSet::new();
        for policy in replay.policies {
            let key = policy.key().clone();
            match self
                .upsert_policy(policy, PolicyOrigin::Kubernetes, false, Duration::ZERO)
                .await
            {
                Ok(update) => {
                    affected.extend(update.endpoints);
                    named.insert(key);
                }
                Err(e @ (ManagerError::Policy(_) | ManagerError::PolicyOriginDisabled { .. })) => {
                    outcome.rejected.push((key.to_string(), e.to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        if !replay.rejected_policies && outcome.rejected.is_empty() {
            let stale: Vec<_> = {
                let state = self.state();
                state
                    .repository
                    .iter()
                    .filter(|p| p.origin == PolicyOrigin::Kubernetes && !named.contains(p.policy.key()))
                    .map(|p| p.policy.key().clone())
                    .collect()
            };
            for key in stale {
                if let Some(update) = self
                    .delete_policy(&key, PolicyOrigin::Kubernetes, false, Duration::ZERO)
                    .await?
                {
                    outcome.policies_removed += 1;
                    affected.extend(update.endpoints);
                }
            }
        }
        outcome.affected_endpoints = affected.len();
        events::kubernetes_replayed(
            &self.inner.metrics,
            [
                ("pod", outcome.pods_forgotten),
                ("namespace", outcome.namespaces_forgotten),
                ("policy", outcome.policies_removed),
            ],
            outcome.affected_endpoints,
            outcome.rejected.len(),
        );
        Ok(outcome)
    }

    /// Endpoints waiting for their pod's labels (on the init identity).
    pub fn labels_pending(&self) -> usize {
        self.state()
            .endpoints
            .values()
            .filter(|s| s.spec.labels_pending)
            .count()
    }
}
