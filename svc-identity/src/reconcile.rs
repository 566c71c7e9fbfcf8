//! When the reconcile passes of this node's keys run: the schedule the
//! allocator's value keys and the IP cache's entries share (a pass when
//! woken, every resync interval, and again with backoff after a failure;
//! each outcome one [`events::reconcile_pass_finished`] event).

use std::time::Duration;

use rivet_common::backoff::Backoff;
use tokio::time::Instant;

use crate::backend::BackendError;
use crate::events::{self, IdentityMetrics, ReconciledKeys};

/// Runs `pass` for ever, one at a time: when `woken` completes (its value is
/// handed to the pass, e.g. whether to write every key again), else every
/// `resync_interval` (with `W::default()`), and, after a failed pass, again
/// after a backoff of 200 ms doubling up to 10 s (reset by a success).
pub(crate) async fn run_passes<
    W: Default,
    Woken: Future<Output = W>,
    Pass: Future<Output = Result<(), BackendError>>,
>(
    keys: ReconciledKeys,
    metrics: &IdentityMetrics,
    resync_interval: Duration,
    mut woken: impl FnMut() -> Woken,
    mut pass: impl FnMut(W) -> Pass,
) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut retry_at: Option<Instant> = None;
    loop {
        let next = retry_at.unwrap_or_else(|| Instant::now() + resync_interval);
        let wake = tokio::select! {
            wake = woken() => wake,
            () = tokio::time::sleep_until(next) => W::default(),
        };
        let result = pass(wake).await;
        let retry_in = match result {
            Ok(()) => {
                backoff.reset();
                None
            }
            Err(_) => Some(backoff.next_delay()),
        };
        retry_at = retry_in.map(|delay| Instant::now() + delay);
        events::reconcile_pass_finished(metrics, keys, &result, retry_in);
    }
}
