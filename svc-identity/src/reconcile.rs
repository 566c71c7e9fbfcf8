//! The reconcile controllers of this node's keys: the schedule the
//! allocator's value keys and the IP cache's entries share (a pass when
//! triggered, every resync interval, and again with backoff after a
//! failure; each outcome one [`events::reconcile_pass_finished`] event), and
//! the controllers that trigger them when the node lease was replaced.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use rivet_common::backoff::Backoff;
use rivet_common::controller::{Action, Controller, Controllers, Trigger};

use crate::backend::{BackendError, IdentityBackend};
use crate::events::{self, IdentityMetrics, ReconciledKeys};

/// Starts controller `name`: `pass` when `trigger` fires, else after the
/// delay its `Ok` names (at most the resync interval), and, after a failed
/// pass, again after a backoff of 200 ms doubling up to 10 s (reset by a
/// success).
pub(crate) fn start<Pass, Fut>(
    controllers: &Controllers,
    name: &'static str,
    keys: ReconciledKeys,
    metrics: &IdentityMetrics,
    trigger: &Trigger,
    mut pass: Pass,
) where
    Pass: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Result<Duration, BackendError>> + Send + 'static,
{
    let metrics = metrics.clone();
    let controller = Controller::new(name)
        .trigger(trigger)
        .backoff(Backoff::new(Duration::from_millis(200), Duration::from_secs(10)));
    controllers.reconcile(controller, move || {
        let (pass, metrics) = (pass(), metrics.clone());
        async move {
            let result = pass.await;
            events::reconcile_pass_finished(&metrics, keys, result.as_ref().map(|_| ()));
            result.map(Action::requeue)
        }
    });
}

/// Starts controller `name`: `renewed` each time `backend` reports a
/// replaced node lease (every key must be written again on the new one).
pub(crate) fn on_lease_renewed(
    controllers: &Controllers,
    name: &'static str,
    backend: &Arc<dyn IdentityBackend>,
    renewed: impl Fn() + Clone + Send + Sync + 'static,
) {
    let backend = backend.clone();
    controllers.supervise(Controller::new(name), move |progress| {
        progress.ok();
        forward(backend.clone(), renewed.clone())
    });
}

async fn forward(backend: Arc<dyn IdentityBackend>, renewed: impl Fn()) -> Result<(), Infallible> {
    // Its own: the allocator's and the IP cache's forwarders both hear
    // every replacement.
    let mut seen = 0;
    loop {
        backend.lease_renewed(&mut seen).await;
        renewed();
    }
}
