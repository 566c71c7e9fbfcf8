//! Each endpoint's worker: the one task that regenerates or removes it,
//! driven by its queue ([`super::queue`]).
//!
//! Workers are supervised by the `endpoint-workers` controller: they live
//! in one [`JoinSet`] beside the manager's state (so a restart of the
//! supervisor loses none), and a worker that panics is started again for
//! its endpoint at once (its queue still holds what it was doing: every
//! step is idempotent) and the panic restarts `endpoint-workers`, which
//! counts it and shows it in `rivet status`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rivet_common::controller::Progress;
use tokio::task::{Id, JoinSet};
use tracing::Instrument;

use super::error::FailureKind;
use super::queue::{Queue, RemovalReason};
use super::{EndpointManager, ManagerError, RegenError};
use crate::endpoint::{EndpointState, RegenerationStep};

/// The running workers: each task's endpoint and queue.
#[derive(Debug, Default)]
pub(super) struct Workers {
    tasks: JoinSet<()>,
    endpoints: HashMap<Id, (u16, Arc<Queue>)>,
}

/// Stops every worker when `endpoint-workers` is cancelled (the daemon
/// shuts down); not when it unwinds to restart after a worker panicked.
struct StopWorkersOnShutdown<'a>(&'a EndpointManager);

impl Drop for StopWorkersOnShutdown<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.0.workers().tasks.abort_all();
        }
    }
}

impl EndpointManager {
    /// Starts the worker of endpoint `id` (supervised by `endpoint-workers`).
    pub(super) fn spawn_worker(&self, id: u16, queue: Arc<Queue>) {
        let this = self.clone();
        let worker = queue.clone();
        let mut workers = self.workers();
        let task = workers.tasks.spawn(async move { this.run_worker(id, worker).await });
        workers.endpoints.insert(task.id(), (id, queue));
        drop(workers);
        self.inner.workers_added.notify_one();
    }

    fn workers(&self) -> std::sync::MutexGuard<'_, Workers> {
        // Nothing panics under this lock.
        self.inner.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `endpoint-workers`: waits for workers to end; one that panicked is
    /// started again for its endpoint (if that is still there) and the
    /// panic goes on to the controller, which counts the restart. Never
    /// returns otherwise.
    pub(super) async fn supervise_workers(&self, progress: Progress) -> Result<(), std::convert::Infallible> {
        let _stop = StopWorkersOnShutdown(self);
        progress.ok();
        loop {
            let ended = std::future::poll_fn(|cx| match self.workers().tasks.poll_join_next_with_id(cx) {
                // No worker at all: wait for one to be added.
                std::task::Poll::Ready(None) => std::task::Poll::Pending,
                other => other,
            });
            let ended = tokio::select! {
                ended = ended => ended,
                () = self.inner.workers_added.notified() => continue,
            };
            let Some(ended) = ended else { continue };
            let task = match &ended {
                Ok((task, ())) => *task,
                Err(e) => e.id(),
            };
            let endpoint = self.workers().endpoints.remove(&task);
            let Err(e) = ended else { continue };
            let Some((id, queue)) = endpoint else { continue };
            if !e.is_panic() {
                // Aborted: only when the manager goes away.
                continue;
            }
            tracing::error!(endpoint = id, "the endpoint's worker panicked; starting it again");
            let still_there = self
                .state()
                .endpoints
                .get(&id)
                .is_some_and(|slot| Arc::ptr_eq(&slot.queue, &queue));
            if still_there {
                self.spawn_worker(id, queue);
            }
            std::panic::resume_unwind(e.into_panic());
        }
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
                // The pod's attributes (OpenTelemetry semantic conventions)
                // are recorded by `regenerate` once it read the spec.
                let span = tracing::info_span!(
                    parent: &target.requester,
                    "regenerate",
                    endpoint = id,
                    reason = %target.reason,
                    k8s.pod.name = tracing::field::Empty,
                    k8s.namespace.name = tracing::field::Empty,
                    k8s.pod.uid = tracing::field::Empty,
                    container.id = tracing::field::Empty,
                    rivet.pod.addresses = tracing::field::Empty,
                    rivet.identity.id = tracing::field::Empty,
                );
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
            if e.kind == FailureKind::InterfaceLost(RemovalReason::InterfaceGone) {
                // svc-loader says the host interface is gone: the pod went
                // without a DEL. (Another interface at its ifindex is found
                // by the periodic check and at restore.)
                self.drop_endpoint(id, RemovalReason::InterfaceGone);
                continue;
            }
            // Retried after a backoff; a new request or a removal cuts it
            // short. Any other wake-up (the previous retry's own request
            // left one) is not a reason to give the retry up.
            let retry = tokio::time::sleep(backoff.next_delay());
            tokio::pin!(retry);
            loop {
                tokio::select! {
                    () = &mut retry => {
                        queue.request("retry after failure");
                        break;
                    }
                    () = queue.wake.notified() => {
                        if queue.is_closed() || queue.has_pending() {
                            break;
                        }
                    }
                }
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
        state.changed(id);
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
                        Err(e) if e.kind == FailureKind::EndpointRemoved => {}
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
