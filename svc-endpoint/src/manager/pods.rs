//! Kubernetes mode: restore asks svc-k8s-sync whether each restored
//! endpoint's pod still exists (DESIGN.md §5, "drop endpoints whose
//! interface or pod is gone"). A pod deleted while svc-endpoint was down
//! (no CNI DEL came) is ABSENT: its endpoint is dropped and its addresses
//! released. An endpoint svc-k8s-sync cannot answer for (its caches not
//! synced, or it is unreachable) is restored and checked again by
//! `pod-check` once it answers: nothing is dropped on the strength of no
//! answer.

use rivet_common::controller::Action;
use rivet_proto::k8s::v1 as k8spb;
use tonic::Status;

use super::queue::RemovalReason;
use super::{EndpointManager, State};
use crate::endpoint::EndpointState;

/// Lookups of one restore in flight at once.
const LOOKUPS_AT_ONCE: usize = 16;

/// Why a pass of `pod-check` stopped (it runs again after a backoff).
#[derive(Debug, thiserror::Error)]
pub(super) enum PodCheckError {
    /// svc-k8s-sync did not answer whether the pod exists.
    #[error("asking svc-k8s-sync whether pod {pod} of endpoint {id} exists: {}", source.message())]
    Lookup {
        /// The endpoint.
        id: u16,
        /// `namespace/name`.
        pod: String,
        /// svc-k8s-sync's answer (CACHE_NOT_SYNCED, or the transport's).
        #[source]
        source: Status,
    },
}

impl State {
    /// The lookup of endpoint `id`'s pod; `None` for an endpoint without a
    /// pod, or being removed.
    fn pod_lookup(&self, id: u16) -> Option<k8spb::LookupPodRequest> {
        let slot = self.endpoints.get(&id)?;
        if slot.spec.pod_name.is_empty() || slot.queue.is_closed() {
            return None;
        }
        Some(k8spb::LookupPodRequest {
            namespace: slot.spec.pod_namespace.clone(),
            name: slot.spec.pod_name.clone(),
            uid: slot.spec.pod_uid.clone(),
        })
    }
}

/// Whether svc-k8s-sync says the pod is gone.
fn absent(response: &k8spb::LookupPodResponse) -> bool {
    response.presence == k8spb::PodPresence::Absent as i32
}

impl EndpointManager {
    /// At restore, in Kubernetes mode: the restored endpoints whose pod
    /// svc-k8s-sync says is gone (not those already in `dropped`). Those
    /// it could not answer for are kept and left to `pod-check`.
    pub(super) async fn pods_gone_at_restore(&self, dropped: &[(u16, RemovalReason)]) -> Vec<(u16, RemovalReason)> {
        let Some(directory) = self.inner.deps.pods.clone() else {
            return Vec::new();
        };
        let candidates: Vec<(u16, k8spb::LookupPodRequest)> = {
            let state = self.state();
            state
                .endpoints
                .iter()
                .filter(|(id, slot)| {
                    slot.status.state == EndpointState::Restoring && !dropped.iter().any(|(d, _)| d == *id)
                })
                .filter_map(|(id, _)| state.pod_lookup(*id).map(|request| (*id, request)))
                .collect()
        };
        let mut gone = Vec::new();
        let mut unanswered: Vec<u16> = Vec::new();
        for chunk in candidates.chunks(LOOKUPS_AT_ONCE) {
            if !unanswered.is_empty() {
                // It did not answer: ask no more now (each call would wait).
                unanswered.extend(chunk.iter().map(|(id, _)| *id));
                continue;
            }
            let answers = futures::future::join_all(chunk.iter().map(|(id, request)| {
                let directory = directory.clone();
                let request = request.clone();
                async move {
                    let answer = directory.lookup(request.clone()).await;
                    (*id, request, answer)
                }
            }))
            .await;
            for (id, request, answer) in answers {
                match answer {
                    Ok(response) if absent(&response) => {
                        tracing::info!(
                            endpoint = id,
                            pod = %format!("{}/{}", request.namespace, request.name),
                            "the restored endpoint's pod was deleted while svc-endpoint was down; dropping it"
                        );
                        gone.push((id, RemovalReason::PodGone));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(endpoint = id, error = %e, "svc-k8s-sync cannot say whether the restored endpoint's pod exists; restoring it and asking again later");
                        unanswered.push(id);
                    }
                }
            }
        }
        if !unanswered.is_empty() {
            self.state().pods_unchecked.extend(unanswered);
        }
        gone
    }

    /// `pod-check` (Kubernetes mode): once restore finished, asks
    /// svc-k8s-sync again about the restored endpoints it could not answer
    /// for; drops those whose pod is gone (counted in the restore's
    /// `dropped`). Until it answers for every one the pass fails and runs
    /// again after a backoff.
    pub(super) async fn recheck_pods(&self) -> Result<Action, PodCheckError> {
        self.restored().await;
        let Some(directory) = self.inner.deps.pods.clone() else {
            return Ok(Action::done());
        };
        let pending: Vec<(u16, Option<k8spb::LookupPodRequest>)> = {
            let state = self.state();
            state
                .pods_unchecked
                .iter()
                .map(|id| (*id, state.pod_lookup(*id)))
                .collect()
        };
        for (id, request) in pending {
            let Some(request) = request else {
                // Gone (deleted) meanwhile.
                self.state().pods_unchecked.remove(&id);
                continue;
            };
            let pod = format!("{}/{}", request.namespace, request.name);
            let response = directory
                .lookup(request)
                .await
                .map_err(|source| PodCheckError::Lookup {
                    id,
                    pod: pod.clone(),
                    source,
                })?;
            self.state().pods_unchecked.remove(&id);
            if absent(&response) {
                tracing::info!(
                    endpoint = id,
                    pod,
                    "the restored endpoint's pod is gone (svc-k8s-sync answered late); dropping it"
                );
                self.drop_endpoint(id, RemovalReason::PodGone);
                self.inner.restore.lock().expect("restore lock poisoned").dropped += 1;
            }
        }
        Ok(Action::done())
    }
}
