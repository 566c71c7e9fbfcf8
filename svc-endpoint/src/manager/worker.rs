//! Each endpoint's worker: the one task that regenerates or removes it,
//! driven by its queue ([`super::queue`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tonic::Code;
use tracing::Instrument;

use super::queue::{Queue, RemovalReason};
use super::{EndpointManager, ManagerError, RegenError};
use crate::endpoint::{EndpointState, RegenerationStep};

impl EndpointManager {
    pub(super) fn spawn_worker(&self, id: u16, queue: Arc<Queue>) {
        let this = self.clone();
        tokio::spawn(async move { this.run_worker(id, queue).await });
    }

    /// The endpoint's worker: regenerates while requests come, removes the
    /// endpoint once asked to and exits when it is gone.
    async fn run_worker(&self, id: u16, queue: Arc<Queue>) {
        let mut backoff = self.inner.options.retry_backoff.clone();
        loop {
            if queue.is_closed() {
                self.remove_until_gone(id, &queue).await;
                return;
            }
            let Some(target) = queue.take_pending() else {
                queue.wake.notified().await;
                continue;
            };
            // The permit first, without the endpoint's lock: a removal never
            // waits behind other endpoints' regenerations.
            let _permit = tokio::select! {
                permit = self.inner.permits.acquire() => permit.expect("semaphore never closed"),
                () = queue.closed() => {
                    queue.finish(target.generation, Err(RegenError::aborted(RegenerationStep::Identity)));
                    continue;
                }
            };
            let result = {
                let _serialised = queue.lock.lock().await;
                let span = tracing::info_span!(parent: &target.requester, "regenerate", endpoint = id, reason = %target.reason);
                self.regenerate(id, &target.reason, &queue).instrument(span).await
            };
            drop(_permit);
            let failure = result.as_ref().err().cloned();
            queue.finish(target.generation, result);
            let Some(e) = failure else {
                backoff.reset();
                continue;
            };
            if queue.is_closed() || !queue.retry.load(Ordering::SeqCst) {
                continue;
            }
            if e.step == RegenerationStep::Datapath && e.status.code() == Code::NotFound {
                // svc-loader says the host interface is gone: the pod went
                // without a DEL. (Another interface at its ifindex is found
                // by the periodic check and at restore.)
                self.drop_endpoint(id, RemovalReason::InterfaceGone);
                continue;
            }
            // Retried after a backoff; a new request or a removal cuts it short.
            tokio::select! {
                () = tokio::time::sleep(backoff.next_delay()) => {
                    queue.request("retry after failure");
                }
                () = queue.wake.notified() => {}
            }
        }
    }

    /// Moves an endpoint that is not being removed to `to`.
    pub(super) fn set_state(&self, id: u16, to: EndpointState, reason: &str) {
        let mut state = self.state();
        let Some(slot) = state.endpoints.get_mut(&id) else {
            return;
        };
        if slot.queue.is_closed() {
            return;
        }
        slot.status.transition(id, to, reason);
        self.update_state_metrics(&state);
    }

    /// Waits for every (endpoint, generation); the first failure or the
    /// deadline ends the wait. Returns how many realised.
    pub(super) async fn wait_all(
        &self,
        waits: &[(u16, Arc<Queue>, u64)],
        deadline: Duration,
    ) -> Result<usize, ManagerError> {
        let all = futures::future::join_all(waits.iter().map(|(id, q, g)| async move { (*id, q.wait(*g).await) }));
        match tokio::time::timeout(deadline, all).await {
            Ok(results) => {
                let mut realised = 0;
                for (id, result) in results {
                    match result {
                        Ok(()) => realised += 1,
                        // A removed endpoint needs nothing realised.
                        Err(e) if e.status.code() == Code::Aborted => {}
                        Err(source) => {
                            return Err(ManagerError::Regeneration {
                                id,
                                undone: false,
                                source,
                            });
                        }
                    }
                }
                Ok(realised)
            }
            Err(_) => Err(ManagerError::Deadline {
                id: waits.first().map_or(0, |(id, ..)| *id),
                undone: false,
            }),
        }
    }
}
