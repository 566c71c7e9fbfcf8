//! One endpoint's work queue, shared between the manager's calls and the
//! endpoint's worker, the one task that regenerates and removes it.
//!
//! Regenerations are requested by generation: a request bumps `requested`
//! and wakes the worker, which regenerates once for every request made so
//! far (coalescing) and publishes `realised` or the failure. A removal is
//! requested the same way (`request_removal`): it closes the queue (no
//! regeneration starts any more, a running one stops at its next step) and
//! the worker makes removal attempts until the endpoint is gone, publishing
//! each attempt's result to whoever waits for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{Notify, watch};
use tonic::Status;

use super::RegenError;
use crate::endpoint::RegenerationStep;

/// A failed removal attempt: what was being removed, and why it failed.
#[derive(Debug, Clone)]
pub(crate) struct RemovalFailure {
    /// "datapath", "ipcache", "identity", "state-dir", "addresses".
    pub step: &'static str,
    /// The dependency's (or the local step's) status.
    pub status: Status,
}

/// Why an endpoint is removed; the removal's log line and metric say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RemovalReason {
    /// DeleteEndpoint.
    Deleted,
    /// A synchronous create failed and is undone.
    CreateFailed,
    /// Its host interface is gone (restore, the periodic check, or a
    /// regeneration told so by svc-loader).
    InterfaceGone,
    /// Its ifindex now names another interface.
    InterfaceReplaced,
    /// Kubernetes mode: svc-k8s-sync says its pod is gone (deleted while
    /// svc-endpoint was down).
    PodGone,
}

impl RemovalReason {
    /// Name for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Deleted => "deleted",
            Self::CreateFailed => "create_failed",
            Self::InterfaceGone => "interface_gone",
            Self::InterfaceReplaced => "interface_replaced",
            Self::PodGone => "pod_gone",
        }
    }

    /// Whether svc-endpoint itself decided the endpoint goes (nobody else
    /// will release its addresses).
    pub fn is_drop(self) -> bool {
        matches!(self, Self::InterfaceGone | Self::InterfaceReplaced | Self::PodGone)
    }
}

/// The removal side of an endpoint's outcome.
#[derive(Debug, Clone, Default)]
pub(crate) struct Removal {
    /// Attempts asked for (each removal request asks for one more).
    pub requested: u64,
    /// Attempts made.
    pub attempted: u64,
    /// The last attempt's failure (`None` before any and after a success).
    pub failed: Option<RemovalFailure>,
    /// Everything is gone and the endpoint is forgotten.
    pub done: bool,
    /// Release the addresses with svc-ipam as well: svc-endpoint dropped the
    /// endpoint itself, or a caller was told its removal failed (the CNI
    /// then keeps the addresses, counting on svc-endpoint to finish).
    pub release_addresses: bool,
    /// The first reason given.
    pub reason: Option<RemovalReason>,
}

/// Regenerations and removal of one endpoint, as its waiters see them.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub requested: u64,
    pub realised: u64,
    /// The generation a failed attempt was for, and why.
    pub failed: Option<(u64, RegenError)>,
    pub reason: String,
    /// The span of the latest request: the regeneration is its child, so a
    /// pod creation is one trace across the daemons.
    pub requester: tracing::Span,
    pub removal: Removal,
}

/// A regeneration the worker took from the queue.
#[derive(Debug)]
pub(crate) struct Target {
    pub generation: u64,
    pub reason: String,
    pub requester: tracing::Span,
}

/// Per-endpoint regeneration and removal bookkeeping, shared with its worker.
#[derive(Debug)]
pub(crate) struct Queue {
    /// Held by a regeneration, a removal attempt and a re-reservation of
    /// the endpoint's addresses (never across a retry's wait).
    pub lock: tokio::sync::Mutex<()>,
    outcome: watch::Sender<Outcome>,
    /// Wakes the worker: a request, a removal, a release of the hold.
    pub wake: Notify,
    /// Set by the first removal request: no regeneration starts any more.
    closed: AtomicBool,
    /// Retry failed regenerations in the background (false for a
    /// synchronous create until its first regeneration succeeded).
    pub retry: AtomicBool,
    /// Regenerations wait while set (restore: until the selector cache and
    /// the addresses are back); removals do not.
    held: AtomicBool,
}

impl Queue {
    /// A queue; `held` keeps regenerations from starting until
    /// [`release_hold`](Self::release_hold).
    pub fn new(retry: bool, held: bool) -> Arc<Self> {
        Arc::new(Self {
            lock: tokio::sync::Mutex::new(()),
            outcome: watch::channel(Outcome {
                requested: 0,
                realised: 0,
                failed: None,
                reason: String::new(),
                requester: tracing::Span::none(),
                removal: Removal::default(),
            })
            .0,
            wake: Notify::new(),
            closed: AtomicBool::new(false),
            retry: AtomicBool::new(retry),
            held: AtomicBool::new(held),
        })
    }

    /// Whether a removal was requested.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// A copy of the outcome now.
    pub fn outcome(&self) -> Outcome {
        self.outcome.borrow().clone()
    }

    /// Requests a regeneration; returns the generation to wait for.
    pub fn request(&self, reason: &str) -> u64 {
        let mut generation = 0;
        self.outcome.send_modify(|o| {
            o.requested += 1;
            o.reason = reason.to_string();
            o.requester = tracing::Span::current();
            generation = o.requested;
        });
        self.wake.notify_one();
        generation
    }

    /// Lets regenerations start (restore is done with the endpoint).
    pub fn release_hold(&self) {
        self.held.store(false, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Whether a regeneration is pending (see [`take_pending`](Self::take_pending)).
    pub fn has_pending(&self) -> bool {
        !self.is_closed() && !self.held.load(Ordering::SeqCst) && Self::pending(&self.outcome.borrow())
    }

    /// Requests not realised yet and not already failed.
    fn pending(o: &Outcome) -> bool {
        o.requested > o.realised && o.failed.as_ref().is_none_or(|(g, _)| *g < o.requested)
    }

    /// The regeneration to run now, if one is pending: requests not realised
    /// yet and not already failed, no hold, not closed. Taken, not cloned:
    /// a span kept in the queue would never close (and never be exported).
    pub fn take_pending(&self) -> Option<Target> {
        if self.is_closed() || self.held.load(Ordering::SeqCst) {
            return None;
        }
        let mut target = None;
        self.outcome.send_if_modified(|o| {
            if Self::pending(o) {
                target = Some(Target {
                    generation: o.requested,
                    reason: o.reason.clone(),
                    requester: std::mem::replace(&mut o.requester, tracing::Span::none()),
                });
            }
            false
        });
        target
    }

    /// Publishes a regeneration's result.
    pub fn finish(&self, generation: u64, result: Result<(), RegenError>) {
        self.outcome.send_modify(|o| match result {
            Ok(()) => {
                o.realised = o.realised.max(generation);
                if o.failed.as_ref().is_some_and(|(g, _)| *g <= generation) {
                    o.failed = None;
                }
            }
            Err(e) => o.failed = Some((generation, e)),
        });
    }

    /// Waits until `generation` is realised, an attempt covering it failed,
    /// or the endpoint is being removed (ABORTED: no regeneration starts
    /// any more, so nothing else would end the wait).
    pub async fn wait(&self, generation: u64) -> Result<(), RegenError> {
        let mut rx = self.outcome.subscribe();
        let outcome = rx
            .wait_for(|o| {
                o.realised >= generation || o.failed.as_ref().is_some_and(|(g, _)| *g >= generation) || self.is_closed()
            })
            .await
            .map_err(|_| RegenError::aborted(RegenerationStep::Identity))?
            .clone();
        if outcome.realised >= generation {
            return Ok(());
        }
        match outcome.failed {
            Some((g, e)) if g >= generation => Err(e),
            _ => Err(RegenError::aborted(RegenerationStep::Identity)),
        }
    }

    /// Resolves once a removal was requested.
    pub async fn closed(&self) {
        let mut rx = self.outcome.subscribe();
        let _ = rx.wait_for(|_| self.is_closed()).await;
    }

    /// Requests a removal attempt (the first one closes the queue); returns
    /// the attempt to wait for. Every regeneration waiter returns ABORTED.
    pub fn request_removal(&self, reason: RemovalReason) -> u64 {
        self.closed.store(true, Ordering::SeqCst);
        let mut attempt = 0;
        self.outcome.send_modify(|o| {
            let removal = &mut o.removal;
            removal.requested += 1;
            removal.release_addresses |= reason.is_drop();
            removal.reason.get_or_insert(reason);
            attempt = removal.requested;
        });
        self.wake.notify_one();
        attempt
    }

    /// The removal attempt to make now: (attempt number, release addresses).
    pub fn removal_target(&self) -> (u64, bool) {
        let o = self.outcome.borrow();
        (
            o.removal.requested.max(o.removal.attempted + 1),
            o.removal.release_addresses,
        )
    }

    /// Asks that the addresses be released too (a caller was told the
    /// removal failed). Call with the manager's state lock held, as the
    /// worker forgets the endpoint under it.
    pub fn release_addresses_when_gone(&self) {
        self.outcome.send_modify(|o| o.removal.release_addresses = true);
    }

    /// Publishes a removal attempt's result; `done` once the endpoint is
    /// forgotten. A failure also asks for the addresses (see [`Removal`]).
    pub fn finish_removal(&self, attempt: u64, result: Result<bool, RemovalFailure>) {
        self.outcome.send_modify(|o| {
            let removal = &mut o.removal;
            removal.attempted = removal.attempted.max(attempt);
            match result {
                Ok(done) => {
                    removal.failed = None;
                    removal.done = done;
                }
                Err(e) => {
                    removal.failed = Some(e);
                    removal.release_addresses = true;
                }
            }
        });
    }

    /// Waits for removal attempt `attempt` (or a later one): Ok once the
    /// endpoint is gone, the failure otherwise.
    pub async fn wait_removal(&self, attempt: u64) -> Result<(), RemovalFailure> {
        let mut rx = self.outcome.subscribe();
        let removal = rx
            .wait_for(|o| o.removal.done || (o.removal.attempted >= attempt && o.removal.failed.is_some()))
            .await
            .map(|o| o.removal.clone())
            .map_err(|_| RemovalFailure {
                step: "worker",
                status: Status::internal("the endpoint's worker is gone"),
            })?;
        match removal.failed {
            Some(e) if !removal.done => Err(e),
            _ => Ok(()),
        }
    }
}
