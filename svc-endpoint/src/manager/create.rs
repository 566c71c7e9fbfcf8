//! Creating an endpoint: a synchronous create waits for the first
//! regeneration and undoes everything when it fails.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use rivet_common::grpc::RpcError;
use rivet_common::labels::Labels;
use rivet_proto::identity::v1 as idpb;
use tonic::{Code, Status};

use super::queue::{Queue, RemovalReason};
use super::{EndpointManager, EndpointView, ManagerError, NewEndpoint, RegenError, Slot};
use crate::endpoint::{EndpointState, EndpointStatus, RegenerationStep};
use crate::events;

impl EndpointManager {
    /// Creates an endpoint. With `sync` it returns once the first
    /// regeneration completed, and undoes everything if it fails or
    /// `deadline` passes. Returns the endpoint and whether it was created
    /// (false for an idempotent repeat).
    pub async fn create(&self, new: NewEndpoint, deadline: Duration) -> Result<(EndpointView, bool), ManagerError> {
        let started = Instant::now();
        // Ids held by the datapath or old state dirs are known only once
        // restore has read them.
        let mut known = self.inner.ids_known.subscribe();
        if tokio::time::timeout(deadline, known.wait_for(|k| *k)).await.is_err() {
            return Err(ManagerError::Restoring);
        }
        let mut synced = self.inner.identities_synced.subscribe();
        let remaining = deadline.saturating_sub(started.elapsed());
        if tokio::time::timeout(remaining, synced.wait_for(|s| *s)).await.is_err() {
            return Err(ManagerError::IdentitiesNotSynced);
        }
        let mut spec = new.spec;
        let (id, queue, generation, created) = {
            let mut state = self.state();
            if let Some(existing) = state
                .endpoints
                .values()
                .find(|s| s.spec.container_id == spec.container_id && s.spec.interface == spec.interface)
            {
                if !existing.spec.same_request(&spec) {
                    return Err(ManagerError::Conflict {
                        container_id: spec.container_id.clone(),
                        interface: spec.interface.clone(),
                        existing: existing.spec.id,
                    });
                }
                if existing.queue.is_closed() {
                    return Err(ManagerError::BeingDeleted {
                        id: existing.spec.id,
                        container_id: spec.container_id.clone(),
                    });
                }
                let outcome = existing.queue.outcome();
                (
                    existing.spec.id,
                    existing.queue.clone(),
                    outcome.requested.max(1),
                    false,
                )
            } else {
                for address in &spec.addresses {
                    if let Some(owner) = state.endpoints.values().find(|s| s.spec.has_address(address.address)) {
                        return Err(ManagerError::AddressInUse {
                            address: address.address,
                            owner: owner.spec.id,
                        });
                    }
                }
                let id = state.allocate_id().ok_or(ManagerError::NoFreeId)?;
                spec.id = id;
                spec.created = SystemTime::now();
                if self.kubernetes_mode() && !spec.pod_name.is_empty() {
                    // Labels and ports only from Kubernetes; the init
                    // identity until they are known.
                    let pod = (spec.pod_namespace.clone(), spec.pod_name.clone());
                    match state.pod_metadata.get(&pod) {
                        Some(metadata) if metadata.describes(&spec) => {
                            metadata.apply_to(&mut spec);
                        }
                        _ => {
                            spec.labels = Labels::new();
                            spec.named_ports = Vec::new();
                            spec.labels_pending = true;
                        }
                    }
                } else if !spec.pod_name.is_empty()
                    && let Some(remembered) = state
                        .pod_labels
                        .get(&(spec.pod_namespace.clone(), spec.pod_name.clone()))
                        .cloned()
                {
                    for label in remembered.iter() {
                        if spec.labels.get_from(label.source(), label.key()).is_none() {
                            let _ = spec.labels.insert(label.clone());
                        }
                    }
                }
                let pod = if spec.pod_name.is_empty() {
                    String::new()
                } else {
                    format!("{}/{}", spec.pod_namespace, spec.pod_name)
                };
                events::endpoint_created(id, &spec.container_id, &spec.interface, &pod);
                let queue = Queue::new(!new.sync, false);
                let mut status = EndpointStatus::new(EndpointState::WaitingForIdentity, "created");
                status.traceparent = rivet_common::telemetry::current_traceparent();
                state.endpoints.insert(
                    id,
                    Slot {
                        spec,
                        status,
                        queue: queue.clone(),
                        persisted: None,
                        resolving: None,
                        changed: 0,
                        claimed_in: None,
                    },
                );
                state.changed(id);
                self.spawn_worker(id, queue.clone());
                let generation = queue.request("created");
                self.update_state_metrics(&state);
                (id, queue, generation, true)
            }
        };
        if !new.sync {
            return Ok((self.view(id)?, created));
        }
        // A label set svc-identity has not seen needs its kvstore: while that
        // is away, allocation answers KVSTORE_UNREACHABLE and is retried
        // within the call's deadline (a label set it already has works
        // locally).
        let mut generation = generation;
        let mut backoff = self.inner.options.retry_backoff.clone();
        let mut unavailable: Option<(u32, RegenError)> = None;
        loop {
            let remaining = deadline.saturating_sub(started.elapsed());
            let source = match tokio::time::timeout(remaining, queue.wait(generation)).await {
                Ok(Ok(())) => {
                    queue.retry.store(true, Ordering::SeqCst);
                    return Ok((self.view(id)?, created));
                }
                Ok(Err(source)) => source,
                Err(_) if !created => return Err(ManagerError::Deadline { id, undone: false }),
                Err(_) => {
                    // Undone once the running regeneration stopped (the
                    // worker removes the endpoint after it).
                    queue.request_removal(RemovalReason::CreateFailed);
                    return Err(match unavailable {
                        Some((attempts, source)) => ManagerError::IdentityUnavailable {
                            id,
                            attempts,
                            waited: started.elapsed(),
                            undone: true,
                            source,
                        },
                        None => ManagerError::Deadline { id, undone: true },
                    });
                }
            };
            if !created {
                return Err(ManagerError::Regeneration {
                    id,
                    undone: false,
                    source,
                });
            }
            let identity_unavailable =
                source.step == RegenerationStep::Identity && identity_unavailable(&source.status);
            let delay = backoff.next_delay();
            if identity_unavailable && started.elapsed() + delay < deadline {
                let attempts = unavailable.as_ref().map_or(0, |(n, _)| *n) + 1;
                tracing::info!(endpoint = id, attempts, error = %source, "no identity yet (svc-identity unavailable); retrying within the deadline");
                unavailable = Some((attempts, source));
                tokio::time::sleep(delay).await;
                generation = queue.request("identity allocation retried");
                continue;
            }
            let undone = self.undo_failed_create(id, &source).await;
            return Err(match unavailable {
                Some((attempts, _)) if identity_unavailable => ManagerError::IdentityUnavailable {
                    id,
                    attempts: attempts + 1,
                    waited: started.elapsed(),
                    undone,
                    source,
                },
                _ => ManagerError::Regeneration { id, undone, source },
            });
        }
    }

    /// Removes the endpoint of a failed synchronous create; whether it is
    /// gone (otherwise the worker keeps trying in the background).
    async fn undo_failed_create(&self, id: u16, failure: &RegenError) -> bool {
        match self.remove_and_wait(id, RemovalReason::CreateFailed, None).await {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(endpoint = id, failure = %failure, error = %e, "undoing a failed create failed; the endpoint stays disconnecting and is retried");
                false
            }
        }
    }
}

/// Whether svc-identity could not allocate for now: its kvstore is
/// unreachable or not listed yet (its reasons), or svc-identity itself is
/// (UNAVAILABLE with no reason: the transport's).
fn identity_unavailable(status: &Status) -> bool {
    let e = RpcError::<idpb::ErrorReason>::from(status.clone());
    match e.reason() {
        Some(reason) => matches!(
            reason,
            idpb::ErrorReason::KvstoreUnreachable | idpb::ErrorReason::StoreNotListed
        ),
        None => e.code() == Code::Unavailable,
    }
}
