//! Removing an endpoint: its worker retries until everything of it is
//! gone; a caller told about a failure keeps its addresses, so the worker
//! releases them too.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use rivet_proto::identity::v1 as idpb;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::loader::v1 as ldpb;
use tonic::Status;

use super::queue::{Queue, RemovalFailure, RemovalReason};
use super::{EndpointManager, EndpointSelector, ManagerError, ipam_owner};
use crate::endpoint::{EndpointSpec, EndpointState, RegenerationFailure, RegenerationStep};
use crate::events;

impl EndpointManager {
    /// Removes the selected endpoints (datapath, identity reference, ipcache
    /// entries, state dir). Does not release addresses: the caller does,
    /// once this returned. Returns the ids removed; an empty list when
    /// nothing matched. On failure, or when `deadline` passes first, the
    /// endpoint stays `disconnecting`, its worker retries until it is gone
    /// and then releases its addresses too (the caller keeps them).
    pub async fn delete(&self, selector: &EndpointSelector, deadline: Duration) -> Result<Vec<u16>, ManagerError> {
        let started = Instant::now();
        // Only the local state dir scan: never waits for another daemon.
        let _ = self.inner.scanned.subscribe().wait_for(|s| *s).await;
        let ids = self.state().find(selector);
        let mut deleted = Vec::new();
        for id in ids {
            let remaining = deadline.saturating_sub(started.elapsed());
            self.remove_and_wait(id, RemovalReason::Deleted, Some(remaining))
                .await?;
            deleted.push(id);
        }
        Ok(deleted)
    }

    /// Requests the endpoint's removal from its worker and waits for that
    /// attempt (at most `deadline`). A caller told about a failure keeps the
    /// endpoint's addresses, so the worker releases them once it succeeds.
    pub(super) async fn remove_and_wait(
        &self,
        id: u16,
        reason: RemovalReason,
        deadline: Option<Duration>,
    ) -> Result<(), ManagerError> {
        let Some((queue, attempt)) = self.request_removal(id, reason) else {
            return Ok(());
        };
        // Also when the call is cancelled (its client gave up first).
        let mut keeps = CallerKeepsAddresses {
            manager: self,
            id,
            queue: &queue,
            armed: true,
        };
        let waited = match deadline {
            Some(deadline) => tokio::time::timeout(deadline, queue.wait_removal(attempt)).await,
            None => Ok(queue.wait_removal(attempt).await),
        };
        let failure = match waited {
            Ok(Ok(())) => {
                keeps.armed = false;
                return Ok(());
            }
            Ok(Err(failure)) => failure,
            Err(_) => {
                // Either it is gone now, or its addresses will be released
                // when it is.
                keeps.armed = false;
                if !self.caller_keeps_addresses(id, &queue) {
                    return Ok(());
                }
                RemovalFailure {
                    step: "waiting",
                    status: Status::unavailable(
                        "the removal did not finish within the call's deadline (a regeneration or a dependency is slow)",
                    ),
                }
            }
        };
        Err(ManagerError::Removal {
            id,
            step: failure.step,
            status: failure.status,
        })
    }

    /// Asks the worker to release the addresses of endpoint `id` once it is
    /// gone, because a caller of its removal keeps them (it was not told the
    /// removal succeeded); whether the endpoint is still there (false: it is
    /// gone already, the removal succeeded). Decided under the state lock,
    /// where the worker forgets the endpoint.
    fn caller_keeps_addresses(&self, id: u16, queue: &Queue) -> bool {
        let state = self.state();
        let present = state.endpoints.contains_key(&id);
        if present {
            queue.release_addresses_when_gone();
        }
        present
    }

    /// Marks the endpoint `disconnecting` and asks its worker for a removal
    /// attempt; the queue and the attempt to wait for (`None`: no such
    /// endpoint).
    pub(super) fn request_removal(&self, id: u16, reason: RemovalReason) -> Option<(Arc<Queue>, u64)> {
        let mut state = self.state();
        let slot = state.endpoints.get_mut(&id)?;
        slot.status
            .transition(id, EndpointState::Disconnecting, reason.as_str());
        let queue = slot.queue.clone();
        state.changed(id);
        self.update_state_metrics(&state);
        let attempt = queue.request_removal(reason);
        Some((queue, attempt))
    }

    /// One removal attempt: everything of the endpoint, and its addresses
    /// when `release_addresses`. Each step tolerates "already gone".
    async fn remove_once(&self, spec: &EndpointSpec, release_addresses: bool) -> Result<(), RemovalFailure> {
        self.release_everything(spec)
            .await
            .map_err(|(step, status)| RemovalFailure { step, status })?;
        if release_addresses && spec.addresses.iter().any(|a| !a.ipam_pool.is_empty()) {
            let released = self
                .inner
                .deps
                .ipam
                .release(ipampb::ReleaseRequest {
                    owner: Some(ipam_owner(spec)),
                })
                .await
                .map_err(|status| RemovalFailure {
                    step: "addresses",
                    status,
                })?;
            let addresses: Vec<String> = released
                .released
                .iter()
                .map(|a| rivet_proto::net::format_address(&a.address))
                .collect();
            tracing::info!(
                endpoint = spec.id,
                ?addresses,
                "released the addresses of a removed endpoint"
            );
        }
        Ok(())
    }

    /// The worker's removal: attempts with backoff until the endpoint is
    /// gone; a new removal request cuts the wait short.
    pub(super) async fn remove_until_gone(&self, id: u16, queue: &Queue) {
        let mut backoff = self.inner.options.retry_backoff.clone();
        let mut failures = 0u32;
        loop {
            let (attempt, release_addresses) = queue.removal_target();
            let Some(spec) = self.state().endpoints.get(&id).map(|s| s.spec.clone()) else {
                queue.finish_removal(attempt, Ok(true));
                return;
            };
            let result = {
                let _serialised = queue.lock.lock().await;
                self.remove_once(&spec, release_addresses).await
            };
            match result {
                Ok(()) => {
                    if self.forget(id, queue, release_addresses) {
                        queue.finish_removal(attempt, Ok(true));
                        return;
                    }
                    // A caller gave up meanwhile: once more, with the addresses.
                    queue.finish_removal(attempt, Ok(false));
                }
                Err(failure) => {
                    failures += 1;
                    {
                        let mut state = self.state();
                        if let Some(slot) = state.endpoints.get_mut(&id) {
                            slot.status.last_error = Some(RegenerationFailure {
                                step: RegenerationStep::Datapath,
                                message: format!("removal failed at {}: {}", failure.step, failure.status.message()),
                                at: SystemTime::now(),
                            });
                            state.changed(id);
                        }
                    }
                    events::removal_failed(&self.inner.metrics, id, failure.step, &failure.status, failures);
                    queue.finish_removal(attempt, Err(failure));
                    tokio::select! {
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                        () = queue.wake.notified() => {}
                    }
                }
            }
        }
    }

    /// Forgets a removed endpoint, unless its addresses must be released
    /// and this attempt did not (a caller gave up after it started).
    fn forget(&self, id: u16, queue: &Queue, released_addresses: bool) -> bool {
        let mut state = self.state();
        let removal = queue.outcome().removal;
        if removal.release_addresses && !released_addresses {
            return false;
        }
        let Some(mut slot) = state.endpoints.remove(&id) else {
            return true;
        };
        let reason = removal.reason.unwrap_or(RemovalReason::Deleted);
        slot.status.transition(id, EndpointState::Disconnected, reason.as_str());
        state.changed(id);
        // Peers stop resolving its named ports.
        self.named_ports_changed(
            &mut state,
            [slot.status.identity],
            slot.spec.addresses.iter().map(|a| a.address),
            "named ports changed",
        );
        // The pod's remembered labels go with its last endpoint (a reused
        // name must not inherit them), unless a failed create is undone:
        // the runtime retries that pod.
        let pod = (slot.spec.pod_namespace.clone(), slot.spec.pod_name.clone());
        if reason != RemovalReason::CreateFailed
            && !pod.1.is_empty()
            && !state.endpoints.values().any(|s| s.spec.is_pod(&pod.0, &pod.1))
        {
            state.pod_labels.remove(&pod);
        }
        self.update_state_metrics(&state);
        drop(state);
        let spec = &slot.spec;
        let addresses: Vec<String> = spec.addresses.iter().map(|a| a.address.to_string()).collect();
        if removal.attempted > 0 {
            events::removal_converged(
                &self.inner.metrics,
                id,
                reason.as_str(),
                removal.attempted,
                released_addresses,
            );
        }
        match reason {
            RemovalReason::Deleted => events::endpoint_deleted(id, reason.as_str()),
            _ => events::endpoint_dropped(
                &self.inner.metrics,
                id,
                reason.as_str(),
                &format!(
                    "{} ({}) addresses {addresses:?}{}",
                    spec.host_interface,
                    spec.container_id,
                    if released_addresses { " released" } else { "" },
                ),
            ),
        }
        true
    }

    /// Datapath entry and attachments, ipcache entries, identity references,
    /// state dir. Each step tolerates "already gone".
    async fn release_everything(&self, spec: &EndpointSpec) -> Result<(), (&'static str, Status)> {
        let deps = &self.inner.deps;
        deps.loader
            .remove(ldpb::RemoveEndpointRequest {
                endpoint_id: u32::from(spec.id),
                host_ifindex: spec.host_ifindex,
            })
            .await
            .or_else(ignore_not_found)
            .map_err(|s| ("datapath", s))?;
        if !spec.addresses.is_empty() {
            deps.identity
                .delete_ip(idpb::DeleteIpRequest {
                    prefixes: spec
                        .addresses
                        .iter()
                        .map(|a| rivet_proto::net::host_prefix(a.address))
                        .collect(),
                    source: idpb::IpcacheSource::LocalEndpoint.into(),
                })
                .await
                .map_err(|s| ("ipcache", s))?;
        }
        deps.identity
            .release(idpb::ReleaseIdentityRequest {
                id: 0,
                owner: spec.identity_owner(),
            })
            .await
            .map_err(|s| ("identity", s))?;
        let state_dir = self.inner.state_dir.clone();
        let id = spec.id;
        tokio::task::spawn_blocking(move || state_dir.remove(id))
            .await
            .map_err(|e| ("state-dir", Status::internal(e.to_string())))?
            .map_err(|e| ("state-dir", Status::internal(e.to_string())))?;
        Ok(())
    }
}

/// While armed, a caller waiting for a removal has not been told it
/// succeeded: on drop (an error, or the call cancelled by its client) the
/// worker is asked to release the endpoint's addresses once it is gone,
/// because such a caller keeps them (rivet-cni does; see
/// [`EndpointManager::caller_keeps_addresses`]). (A removal that completes
/// in the instant its caller goes away still leaves the addresses to the
/// caller.)
struct CallerKeepsAddresses<'a> {
    manager: &'a EndpointManager,
    id: u16,
    queue: &'a Queue,
    armed: bool,
}

impl Drop for CallerKeepsAddresses<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.manager.caller_keeps_addresses(self.id, self.queue);
        }
    }
}

/// svc-loader has nothing of the endpoint left to remove.
fn ignore_not_found<T: Default>(status: Status) -> Result<T, Status> {
    use rivet_proto::loader::v1::ErrorReason as R;
    match rivet_common::grpc::error_reason(&status) {
        Some(R::InterfaceNotFound | R::EndpointNotFound) => Ok(T::default()),
        _ => Err(status),
    }
}
