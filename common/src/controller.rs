//! Supervised background loops: every loop a daemon runs besides serving
//! gRPC is a controller here, so none can die silently.
//!
//! Two forms, both in the style of kube-runtime's `Controller`:
//!
//! - **reconcile** ([`Controllers::reconcile`]): a function that brings the
//!   world one step closer to what is desired and returns the next
//!   [`Action`] — run again after a delay, when its [`Trigger`] fires, or
//!   never. An error goes to the error policy: the controller's
//!   [`Backoff`], reset by the next success. The runtime owns the loop, the
//!   waits and the retries; the function has no loop of its own.
//! - **supervised** ([`Controllers::supervise`]): a future that runs for
//!   ever (a watcher over a stream, a session with another daemon). When it
//!   returns — with an error or not — or panics, it is started again after
//!   a backoff; it resets the backoff by reporting [`Progress`].
//!
//! Either way a panic is caught and the loop restarted, and each restart is
//! logged and counted (`rivet_controller_restarts_total{controller,reason}`,
//! `reason` = `panic`, `exited` or `error`). Reconcile passes are counted
//! (`rivet_controller_reconciles_total{controller,result}`) and timed
//! (`rivet_controller_reconcile_duration_seconds{controller}`);
//! `rivet_controller_failing{controller}` is 1 while a controller's last
//! outcome was a failure. Every daemon serves the controllers' state in
//! `rivet.daemon.v1.DaemonInfo` (`rivet status`); a controller failing for
//! longer than its [`Controller::degraded_after`] makes its daemon degraded.
//!
//! All tasks live in one `JoinSet` under one cancellation token:
//! [`Controllers::shutdown`] cancels them all (dropping whatever each was
//! awaiting) and waits until every one has stopped.
//!
//! Not for short-lived work a request waits on (spawn and await that), nor
//! for a daemon's gRPC server itself (`daemon::run` owns that).
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//! use rivet_common::controller::{Action, Controller, Controllers, Trigger};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let controllers = Controllers::new();
//! let trigger = Trigger::new();
//! let passes = Arc::new(AtomicU32::new(0));
//! let seen = passes.clone();
//! controllers.reconcile(Controller::new("example").trigger(&trigger), move || {
//!     let passes = passes.clone();
//!     async move {
//!         passes.fetch_add(1, Ordering::SeqCst);
//!         Ok::<_, std::io::Error>(Action::requeue(Duration::from_secs(60)))
//!     }
//! });
//! trigger.trigger(); // runs a pass now instead of in 60 s
//! controllers.wait_outcomes("example", 2).await;
//! assert!(seen.load(Ordering::SeqCst) >= 2);
//! controllers.shutdown().await;
//! # }
//! ```

use std::collections::BTreeMap;
use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::FutureExt as _;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use rivet_proto::daemon::v1 as pb;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
// Tokio's clock, so tests with paused time see ages and durations exactly.
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;

/// How long a controller may fail before its daemon counts as degraded,
/// unless [`Controller::degraded_after`] says otherwise.
pub const DEFAULT_DEGRADED_AFTER: Duration = Duration::from_secs(30);

/// What a reconcile function wants next.
///
/// ```
/// use rivet_common::controller::Action;
/// use std::time::Duration;
/// assert_eq!(Action::requeue(Duration::from_secs(5)), Action::Requeue(Duration::from_secs(5)));
/// assert_ne!(Action::await_change(), Action::done());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run again after this delay, or earlier when the trigger fires (a
    /// periodic resync is what makes a level-triggered loop converge even
    /// when a change notification was missed).
    Requeue(Duration),
    /// Run again only when the trigger fires.
    AwaitChange,
    /// Finished for good (a one-shot job that completed): never run again.
    Done,
}

impl Action {
    /// [`Action::Requeue`].
    pub fn requeue(after: Duration) -> Self {
        Self::Requeue(after)
    }

    /// [`Action::AwaitChange`].
    pub fn await_change() -> Self {
        Self::AwaitChange
    }

    /// [`Action::Done`].
    pub fn done() -> Self {
        Self::Done
    }
}

/// Wakes a reconcile controller now: a change it acts on happened. Clones
/// share one wake-up; triggers while a pass runs coalesce into one more pass.
///
/// ```
/// let trigger = rivet_common::controller::Trigger::new();
/// trigger.trigger();
/// trigger.clone().trigger(); // coalesced with the first
/// ```
#[derive(Debug, Clone, Default)]
pub struct Trigger(Arc<Notify>);

impl Trigger {
    /// A trigger nobody has fired.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks for a pass as soon as the running one (if any) ends.
    pub fn trigger(&self) {
        // One stored permit: several triggers before the wait make one pass.
        self.0.notify_one();
    }

    async fn fired(&self) {
        self.0.notified().await;
    }
}

/// A controller's name and policies; give it to [`Controllers::reconcile`]
/// or [`Controllers::supervise`].
///
/// ```
/// use rivet_common::backoff::Backoff;
/// use rivet_common::controller::{Controller, Trigger};
/// use std::time::Duration;
///
/// let trigger = Trigger::new();
/// let c = Controller::new("ipcache-publish")
///     .backoff(Backoff::new(Duration::from_millis(100), Duration::from_secs(10)))
///     .trigger(&trigger)
///     .degraded_after(Duration::from_secs(60));
/// assert_eq!(c.name(), "ipcache-publish");
/// ```
#[derive(Debug, Clone)]
pub struct Controller {
    name: &'static str,
    backoff: Backoff,
    trigger: Trigger,
    degraded_after: Duration,
}

impl Controller {
    /// A controller called `name` (a metric label and the name `rivet
    /// status` shows: lower case, `-` between words, unique in its daemon),
    /// with a backoff of 100 ms doubling up to 10 s and its own trigger.
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(10)),
            trigger: Trigger::new(),
            degraded_after: DEFAULT_DEGRADED_AFTER,
        }
    }

    /// The name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The error policy: the delay before retrying a failed reconcile or
    /// restarting a loop that ended (default 100 ms doubling up to 10 s).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Runs a reconcile pass when `trigger` fires (a clone is kept).
    pub fn trigger(mut self, trigger: &Trigger) -> Self {
        self.trigger = trigger.clone();
        self
    }

    /// How long the controller may fail before its daemon counts as
    /// degraded (default [`DEFAULT_DEGRADED_AFTER`]).
    pub fn degraded_after(mut self, after: Duration) -> Self {
        self.degraded_after = after;
        self
    }
}

/// Lets a supervised loop say it is doing its job (connected, a watch
/// established, an event handled): the controller counts as healthy and,
/// with [`ok`](Self::ok), its restart backoff starts over.
///
/// ```
/// use rivet_common::controller::{Controller, Controllers};
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let controllers = Controllers::new();
/// controllers.supervise(Controller::new("watcher"), |progress| async move {
///     progress.ok(); // e.g. the watch stream is open
///     std::future::pending::<Result<(), std::io::Error>>().await
/// });
/// controllers.wait_outcomes("watcher", 1).await;
/// assert!(!controllers.status()[0].failing());
/// controllers.shutdown().await;
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Progress {
    cell: Arc<Cell>,
    /// This run made progress: its end restarts at the initial delay.
    progressed: Arc<AtomicBool>,
}

impl Progress {
    /// Records a success now; the next restart waits the initial delay.
    pub fn ok(&self) {
        self.progressed.store(true, Ordering::Release);
        self.cell.succeeded(None);
    }

    /// Records a success now without starting the backoff over: for a step
    /// (a listing) that says the loop works but not that it will stay up
    /// (the watch after it may fail at once, again and again).
    pub fn healthy(&self) {
        self.cell.succeeded(None);
    }
}

/// A controller's state, as `rivet status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControllerState {
    /// Running; its last outcome (if any) was a success.
    Running,
    /// Its last outcome was an error, an exit or a panic; retrying.
    Failing,
    /// A reconcile controller that returned [`Action::Done`].
    Done,
    /// Stopped by [`Controllers::shutdown`].
    Stopped,
}

impl ControllerState {
    /// `running`, `failing`, `done`, `stopped`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Failing => "failing",
            Self::Done => "done",
            Self::Stopped => "stopped",
        }
    }

    fn to_proto(self) -> pb::ControllerState {
        match self {
            Self::Running => pb::ControllerState::Running,
            Self::Failing => pb::ControllerState::Failing,
            Self::Done => pb::ControllerState::Done,
            Self::Stopped => pb::ControllerState::Stopped,
        }
    }
}

/// One controller's state at a moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerStatus {
    /// Its name.
    pub name: &'static str,
    /// Running, failing, done or stopped.
    pub state: ControllerState,
    /// Times its loop was started again after a panic or an end.
    pub restarts: u64,
    /// Failures (reconcile errors, ends, panics) since the last success.
    pub consecutive_failures: u64,
    /// The last failure's message (kept after a success, for operators).
    pub last_error: Option<String>,
    /// Time since the last success; `None` before the first.
    pub last_success_age: Option<Duration>,
    /// Time since it started failing; `None` unless failing.
    pub failing_for: Option<Duration>,
    /// How long it may fail before its daemon is degraded.
    pub degraded_after: Duration,
    /// Successes (reconcile passes, [`Progress::ok`]) and failures so far:
    /// what tests and [`Controllers::wait_outcomes`] wait on.
    pub outcomes: u64,
}

impl ControllerStatus {
    /// Whether its last outcome was a failure.
    pub fn failing(&self) -> bool {
        self.state == ControllerState::Failing
    }

    /// Whether it has been failing for longer than it may.
    pub fn degraded(&self) -> bool {
        self.failing_for.is_some_and(|f| f >= self.degraded_after)
    }

    /// The message form.
    pub fn to_proto(&self) -> pb::ControllerStatus {
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        pb::ControllerStatus {
            name: self.name.to_string(),
            state: self.state.to_proto() as i32,
            restarts: self.restarts,
            consecutive_failures: self.consecutive_failures,
            last_error: self.last_error.clone().unwrap_or_default(),
            last_success_age_ms: self.last_success_age.map(millis),
            failing_for_ms: self.failing_for.map(millis),
            degraded: self.degraded(),
        }
    }
}

/// Why a loop was restarted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum RestartReason {
    Panic,
    Exited,
    Error,
}

impl RestartReason {
    fn as_str(self) -> &'static str {
        match self {
            Self::Panic => "panic",
            Self::Exited => "exited",
            Self::Error => "error",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RestartLabels {
    controller: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcileLabels {
    controller: &'static str,
    result: &'static str,
}

/// The controllers' metrics (`rivet_controller_*`).
#[derive(Clone, Debug)]
struct Metrics {
    restarts: Family<RestartLabels, Counter>,
    reconciles: Family<ReconcileLabels, Counter>,
    reconcile_duration: Family<ControllerLabels, Histogram>,
    failing: Family<ControllerLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            restarts: Family::default(),
            reconciles: Family::default(),
            reconcile_duration: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0005, 2.0, 16))),
            failing: Family::default(),
        }
    }
}

impl Metrics {
    fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("controller");
        r.register(
            "restarts",
            "Loops started again after a panic, an end or an error, by controller and reason",
            self.restarts.clone(),
        );
        r.register(
            "reconciles",
            "Reconcile passes by controller and result (ok, error)",
            self.reconciles.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Duration of reconcile passes by controller",
            self.reconcile_duration.clone(),
        );
        r.register(
            "failing",
            "1 while a controller's last outcome was a failure",
            self.failing.clone(),
        );
    }
}

/// One controller's live state, shared by its task and the status board.
#[derive(Debug)]
struct Cell {
    name: &'static str,
    degraded_after: Duration,
    metrics: Metrics,
    state: Mutex<CellState>,
    /// Outcomes so far; waited on by [`Controllers::wait_outcomes`].
    outcomes: watch::Sender<u64>,
}

#[derive(Debug)]
struct CellState {
    state: ControllerState,
    restarts: u64,
    consecutive_failures: u64,
    last_error: Option<String>,
    last_success: Option<Instant>,
    failing_since: Option<Instant>,
}

impl Cell {
    fn new(name: &'static str, degraded_after: Duration, metrics: Metrics) -> Self {
        metrics
            .failing
            .get_or_create(&ControllerLabels { controller: name })
            .set(0);
        Self {
            name,
            degraded_after,
            metrics,
            state: Mutex::new(CellState {
                state: ControllerState::Running,
                restarts: 0,
                consecutive_failures: 0,
                last_error: None,
                last_success: None,
                failing_since: None,
            }),
            outcomes: watch::channel(0).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, CellState> {
        // Nothing under this lock panics; a poisoned lock still holds sane state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn labels(&self) -> ControllerLabels {
        ControllerLabels { controller: self.name }
    }

    /// A success: a reconcile pass that took `took`, or progress.
    fn succeeded(&self, took: Option<Duration>) {
        {
            let mut st = self.lock();
            if st.state == ControllerState::Failing {
                tracing::info!(
                    controller = self.name,
                    failures = st.consecutive_failures,
                    "controller recovered"
                );
            }
            st.state = ControllerState::Running;
            st.consecutive_failures = 0;
            st.failing_since = None;
            st.last_success = Some(Instant::now());
        }
        self.metrics.failing.get_or_create(&self.labels()).set(0);
        if let Some(took) = took {
            self.reconciled("ok", took);
        }
        self.outcomes.send_modify(|n| *n += 1);
    }

    fn reconciled(&self, result: &'static str, took: Duration) {
        self.metrics
            .reconciles
            .get_or_create(&ReconcileLabels {
                controller: self.name,
                result,
            })
            .inc();
        self.metrics
            .reconcile_duration
            .get_or_create(&self.labels())
            .observe(took.as_secs_f64());
    }

    fn failed(&self, error: String) {
        let mut st = self.lock();
        st.state = ControllerState::Failing;
        st.consecutive_failures += 1;
        st.failing_since.get_or_insert_with(Instant::now);
        st.last_error = Some(error);
        drop(st);
        self.metrics.failing.get_or_create(&self.labels()).set(1);
    }

    /// Event: a reconcile pass failed; retried after `delay`.
    fn reconcile_failed(&self, error: String, took: Duration, delay: Duration) {
        tracing::warn!(controller = self.name, error = %error, ?delay, "reconcile failed; retrying");
        self.failed(error);
        self.reconciled("error", took);
        self.outcomes.send_modify(|n| *n += 1);
    }

    /// Event: a loop ended or panicked; started again after `delay`.
    fn restarted(&self, reason: RestartReason, error: String, delay: Duration) {
        match reason {
            RestartReason::Panic => {
                tracing::error!(controller = self.name, error = %error, ?delay, "controller panicked; restarting it")
            }
            RestartReason::Exited | RestartReason::Error => {
                tracing::warn!(controller = self.name, reason = reason.as_str(), error = %error, ?delay, "controller ended; restarting it")
            }
        }
        self.failed(error);
        self.lock().restarts += 1;
        self.metrics
            .restarts
            .get_or_create(&RestartLabels {
                controller: self.name,
                reason: reason.as_str(),
            })
            .inc();
        self.outcomes.send_modify(|n| *n += 1);
    }

    fn finished(&self, state: ControllerState) {
        self.lock().state = state;
        self.metrics.failing.get_or_create(&self.labels()).set(0);
        self.outcomes.send_modify(|n| *n += 1);
    }

    fn status(&self) -> ControllerStatus {
        let st = self.lock();
        ControllerStatus {
            name: self.name,
            state: st.state,
            restarts: st.restarts,
            consecutive_failures: st.consecutive_failures,
            last_error: st.last_error.clone(),
            last_success_age: st.last_success.map(|t| t.elapsed()),
            failing_for: st.failing_since.map(|t| t.elapsed()),
            degraded_after: self.degraded_after,
            outcomes: *self.outcomes.borrow(),
        }
    }
}

/// The message of a caught panic.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(s), _) => format!("panicked: {s}"),
        (_, Some(s)) => format!("panicked: {s}"),
        _ => "panicked".into(),
    }
}

#[derive(Debug, Default)]
struct Inner {
    cancel: CancellationToken,
    tasks: Mutex<JoinSet<()>>,
    /// Every controller of the daemon: this set's and its children's.
    board: Arc<Mutex<BTreeMap<&'static str, Arc<Cell>>>>,
    /// This set's own controllers.
    own: Mutex<Vec<Arc<Cell>>>,
    metrics: Metrics,
}

impl Drop for Inner {
    /// The tasks abort with the `JoinSet`; the controllers leave the board
    /// (a component that is dropped and made again reuses their names).
    fn drop(&mut self) {
        let own = std::mem::take(self.own.get_mut().unwrap_or_else(|e| e.into_inner()));
        let mut board = self.board.lock().unwrap_or_else(|e| e.into_inner());
        for cell in own {
            if board.get(cell.name).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                board.remove(cell.name);
            }
        }
    }
}

/// A daemon's controllers: every background loop it runs, supervised,
/// under one cancellation. Cheap to clone (one shared set).
///
/// ```
/// use rivet_common::controller::{Controller, Controllers};
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let controllers = Controllers::new();
/// let mut registry = prometheus_client::registry::Registry::with_prefix("rivet");
/// controllers.register_metrics(&mut registry);
/// controllers.supervise(Controller::new("forever"), |_| std::future::pending::<Result<(), String>>());
/// assert_eq!(controllers.status()[0].name, "forever");
/// controllers.shutdown().await; // cancels and waits
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct Controllers(Arc<Inner>);

impl Controllers {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `rivet_controller_*` under `registry` (prefix it with `rivet`).
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.0.metrics.register(registry);
    }

    /// Cancelled when the daemon shuts down; a controller's future is
    /// dropped at its next await then, so most need not look at it.
    pub fn cancellation(&self) -> CancellationToken {
        self.0.cancel.clone()
    }

    /// A set for one component's controllers (an etcd backend's lease
    /// keeper): shown and counted with this set's, cancelled by its
    /// [`shutdown`](Self::shutdown), and stopped — its controllers leaving
    /// the status — when the component drops it.
    ///
    /// ```
    /// use rivet_common::controller::{Controller, Controllers};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let daemon = Controllers::new();
    /// let component = daemon.child();
    /// component.supervise(Controller::new("keeper"), |_| std::future::pending::<Result<(), String>>());
    /// assert_eq!(daemon.status()[0].name, "keeper");
    /// drop(component);
    /// assert!(daemon.status().is_empty());
    /// # }
    /// ```
    pub fn child(&self) -> Controllers {
        Controllers(Arc::new(Inner {
            cancel: self.0.cancel.child_token(),
            tasks: Mutex::default(),
            board: self.0.board.clone(),
            own: Mutex::default(),
            metrics: self.0.metrics.clone(),
        }))
    }

    fn cell(&self, controller: &Controller) -> Arc<Cell> {
        let cell = Arc::new(Cell::new(
            controller.name,
            controller.degraded_after,
            self.0.metrics.clone(),
        ));
        let previous = self
            .0
            .board
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(controller.name, cell.clone());
        self.0.own.lock().unwrap_or_else(|e| e.into_inner()).push(cell.clone());
        assert!(
            previous.is_none(),
            "controller {:?} started twice (names are unique per daemon)",
            controller.name
        );
        cell
    }

    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let cancel = self.0.cancel.clone();
        self.0
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .spawn(async move {
                tokio::select! {
                    // Cancelled first: nothing runs after a shutdown.
                    biased;
                    () = cancel.cancelled() => {}
                    () = task => {}
                }
            });
    }

    /// Runs `reconcile` over and over as its [`Action`]s say: first at once,
    /// then after the requeue delay or when the controller's trigger fires.
    /// An `Err` is retried after the controller's backoff (reset by a
    /// success) or when the trigger fires, whichever comes first; a panic is
    /// caught, counted as a restart and retried after the backoff. Returns at once; the loop runs until [`shutdown`](Self::shutdown).
    ///
    /// ```
    /// use rivet_common::controller::{Action, Controller, Controllers};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let controllers = Controllers::new();
    /// controllers.reconcile(Controller::new("once"), || async { Ok::<_, String>(Action::done()) });
    /// controllers.wait_outcomes("once", 2).await; // the pass, then done
    /// assert_eq!(controllers.status()[0].state.as_str(), "done");
    /// # }
    /// ```
    ///
    /// # Panics
    /// When a controller of the same name was started before.
    pub fn reconcile<F, Fut, E>(&self, controller: Controller, mut reconcile: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        let cell = self.cell(&controller);
        let Controller {
            mut backoff, trigger, ..
        } = controller;
        self.spawn(async move {
            loop {
                let started = Instant::now();
                let outcome = AssertUnwindSafe(reconcile()).catch_unwind().await;
                let took = started.elapsed();
                let action = match outcome {
                    Ok(Ok(action)) => {
                        backoff.reset();
                        cell.succeeded(Some(took));
                        action
                    }
                    Ok(Err(error)) => {
                        let delay = backoff.next_delay();
                        cell.reconcile_failed(error.to_string(), took, delay);
                        // A change may be what it waited for: the trigger
                        // cuts the backoff short (kube's scheduler does too).
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            () = trigger.fired() => {}
                        }
                        continue;
                    }
                    Err(panic) => {
                        let delay = backoff.next_delay();
                        cell.restarted(RestartReason::Panic, panic_message(&*panic), delay);
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                };
                match action {
                    Action::Requeue(after) => {
                        tokio::select! {
                            () = tokio::time::sleep(after) => {}
                            () = trigger.fired() => {}
                        }
                    }
                    Action::AwaitChange => trigger.fired().await,
                    Action::Done => {
                        cell.finished(ControllerState::Done);
                        return;
                    }
                }
            }
        });
    }

    /// Runs the future `run` makes for ever: when it returns (`Ok`: it
    /// "exited", `Err`: an "error") or panics, the end is logged and
    /// counted and a new one is started after the controller's backoff. The
    /// future gets a [`Progress`] to report that it works (which resets the
    /// backoff). Returns at once; runs until [`shutdown`](Self::shutdown).
    ///
    /// ```
    /// use rivet_common::controller::{Controller, Controllers};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let controllers = Controllers::new();
    /// controllers.supervise(Controller::new("watch"), |progress| async move {
    ///     // e.g. open a stream, progress.ok(), handle events until it fails:
    ///     progress.ok();
    ///     Err::<(), _>("the stream ended")
    /// });
    /// controllers.wait_outcomes("watch", 4).await;
    /// assert!(controllers.status()[0].restarts >= 1);
    /// controllers.shutdown().await;
    /// # }
    /// ```
    ///
    /// # Panics
    /// When a controller of the same name was started before.
    pub fn supervise<F, Fut, E>(&self, controller: Controller, mut run: F)
    where
        F: FnMut(Progress) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        let cell = self.cell(&controller);
        let mut backoff = controller.backoff;
        self.spawn(async move {
            loop {
                let progressed = Arc::new(AtomicBool::new(false));
                let progress = Progress {
                    cell: cell.clone(),
                    progressed: progressed.clone(),
                };
                let outcome = AssertUnwindSafe(run(progress)).catch_unwind().await;
                if progressed.load(Ordering::Acquire) {
                    // It worked for a while: the next failure starts over.
                    backoff.reset();
                }
                let delay = backoff.next_delay();
                let (reason, error) = match outcome {
                    Ok(Ok(())) => (RestartReason::Exited, "returned".to_string()),
                    Ok(Err(error)) => (RestartReason::Error, error.to_string()),
                    Err(panic) => (RestartReason::Panic, panic_message(&*panic)),
                };
                cell.restarted(reason, error, delay);
                tokio::time::sleep(delay).await;
            }
        });
    }

    /// Every controller's state, by name.
    pub fn status(&self) -> Vec<ControllerStatus> {
        self.cells().iter().map(|c| c.status()).collect()
    }

    fn cells(&self) -> Vec<Arc<Cell>> {
        self.0
            .board
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Why the daemon is degraded: the controllers failing for longer
    /// than they may, with their last errors; `None` when none is.
    pub fn degraded(&self) -> Option<String> {
        let failing: Vec<String> = self
            .status()
            .into_iter()
            .filter(ControllerStatus::degraded)
            .map(|s| {
                format!(
                    "controller {} failing for {}s: {}",
                    s.name,
                    s.failing_for.unwrap_or_default().as_secs(),
                    s.last_error.as_deref().unwrap_or("")
                )
            })
            .collect();
        (!failing.is_empty()).then(|| failing.join("; "))
    }

    /// Waits until controller `name` has had at least `outcomes` outcomes
    /// (successes, failures, restarts and the final one); for tests and
    /// start-up sequencing. Returns at once for an unknown name.
    pub async fn wait_outcomes(&self, name: &str, outcomes: u64) {
        let cell = self
            .0
            .board
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned();
        if let Some(cell) = cell {
            let mut rx = cell.outcomes.subscribe();
            let _ = rx.wait_for(|n| *n >= outcomes).await;
        }
    }

    /// Cancels every controller (its children's too) and waits until this
    /// set's have stopped. Later [`reconcile`](Self::reconcile) /
    /// [`supervise`](Self::supervise) calls start nothing.
    pub async fn shutdown(&self) {
        self.0.cancel.cancel();
        let mut tasks = std::mem::take(&mut *self.0.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        while let Some(result) = tasks.join_next().await {
            if let Err(e) = result
                && e.is_panic()
            {
                tracing::error!(error = %e, "a controller's supervisor panicked");
            }
        }
        let own = self.0.own.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for cell in own {
            if cell.lock().state != ControllerState::Done {
                cell.finished(ControllerState::Stopped);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn no_jitter(initial_ms: u64, max_ms: u64) -> Backoff {
        Backoff::new(Duration::from_millis(initial_ms), Duration::from_millis(max_ms)).with_jitter(0.0)
    }

    fn metrics_text(controllers: &Controllers) -> String {
        let mut registry = Registry::with_prefix("rivet");
        controllers.register_metrics(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    /// Asserts that `series` (exactly as printed) has `value` in `text`.
    fn assert_sample(text: &str, series: &str, value: f64) {
        assert_eq!(
            crate::testing::metric_sample(text, series),
            Some(value),
            "{series}:\n{text}"
        );
    }

    fn status_of(controllers: &Controllers, name: &str) -> ControllerStatus {
        controllers
            .status()
            .into_iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("controller {name} is listed"))
    }

    /// Counts calls; the guard it hands out notes when a run was dropped.
    #[derive(Debug, Default)]
    struct Calls {
        started: AtomicU32,
        dropped: AtomicU32,
    }

    struct DropGuard(Arc<Calls>);

    impl Drop for DropGuard {
        fn drop(&mut self) {
            self.0.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_supervised_loop_that_panics_is_restarted_counted_and_shown() {
        let controllers = Controllers::new();
        let calls = Arc::new(Calls::default());
        let c = calls.clone();
        controllers.supervise(Controller::new("watch").backoff(no_jitter(10, 1000)), move |progress| {
            let n = c.started.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 2 {
                    panic!("stream broke #{n}");
                }
                progress.ok();
                std::future::pending::<Result<(), String>>().await
            }
        });
        controllers.wait_outcomes("watch", 3).await;
        let s = status_of(&controllers, "watch");
        assert_eq!(
            calls.started.load(Ordering::SeqCst),
            3,
            "started again after each panic"
        );
        assert_eq!(s.restarts, 2);
        assert_eq!(s.state, ControllerState::Running, "healthy once it reported progress");
        assert_eq!(s.last_error.as_deref(), Some("panicked: stream broke #1"));
        assert!(s.last_success_age.is_some());
        let text = metrics_text(&controllers);
        assert_sample(
            &text,
            r#"rivet_controller_restarts_total{controller="watch",reason="panic"}"#,
            2.0,
        );
        assert_sample(&text, r#"rivet_controller_failing{controller="watch"}"#, 0.0);
        controllers.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_supervised_loop_that_returns_is_restarted_with_backoff_reset_by_progress() {
        let controllers = Controllers::new();
        let starts = Arc::new(Mutex::new(Vec::new()));
        let s = starts.clone();
        let t0 = tokio::time::Instant::now();
        controllers.supervise(
            Controller::new("session").backoff(no_jitter(100, 1000)),
            move |progress| {
                let mut starts = s.lock().unwrap();
                starts.push(t0.elapsed().as_millis());
                let n = starts.len();
                async move {
                    match n {
                        1 => Ok(()),                          // exited
                        2 => Err("connection refused"),       // error
                        3 => Err("connection refused again"), // error
                        4 => {
                            progress.ok(); // worked for a while
                            Err("lost the connection")
                        }
                        _ => {
                            progress.ok();
                            std::future::pending().await
                        }
                    }
                }
            },
        );
        controllers.wait_outcomes("session", 6).await;
        // Delays 100, 200, 400; then progress resets: 100 again.
        assert_eq!(*starts.lock().unwrap(), [0, 100, 300, 700, 800]);
        let text = metrics_text(&controllers);
        assert_sample(
            &text,
            r#"rivet_controller_restarts_total{controller="session",reason="exited"}"#,
            1.0,
        );
        assert_sample(
            &text,
            r#"rivet_controller_restarts_total{controller="session",reason="error"}"#,
            3.0,
        );
        let status = status_of(&controllers, "session");
        assert_eq!(status.restarts, 4);
        assert_eq!(status.state, ControllerState::Running, "working again");
        assert_eq!(
            status.last_error.as_deref(),
            Some("lost the connection"),
            "kept for operators"
        );
        controllers.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn healthy_marks_success_without_starting_the_backoff_over() {
        let controllers = Controllers::new();
        let starts = Arc::new(Mutex::new(Vec::new()));
        let s = starts.clone();
        let t0 = tokio::time::Instant::now();
        controllers.supervise(
            Controller::new("relist").backoff(no_jitter(100, 1000)),
            move |progress| {
                s.lock().unwrap().push(t0.elapsed().as_millis());
                async move {
                    progress.healthy(); // listed; the watch then fails at once
                    Err::<(), _>("watch refused")
                }
            },
        );
        controllers.wait_outcomes("relist", 8).await;
        assert_eq!(*starts.lock().unwrap(), [0, 100, 300, 700]);
        assert_eq!(status_of(&controllers, "relist").last_success_age, Some(Duration::ZERO));
        controllers.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn reconcile_errors_back_off_and_a_success_resets_the_backoff() {
        let controllers = Controllers::new();
        let passes = Arc::new(Mutex::new(Vec::new()));
        let p = passes.clone();
        let t0 = tokio::time::Instant::now();
        controllers.reconcile(Controller::new("publish").backoff(no_jitter(100, 300)), move || {
            let mut passes = p.lock().unwrap();
            passes.push(t0.elapsed().as_millis());
            let n = passes.len();
            async move {
                match n {
                    1..=4 => Err(format!("store unreachable #{n}")),
                    5 => Ok(Action::requeue(Duration::from_millis(1000))),
                    6 => Err("store unreachable again".to_string()),
                    _ => Ok(Action::await_change()),
                }
            }
        });
        controllers.wait_outcomes("publish", 7).await;
        // 100, 200, 300 (capped), 300; success at 900 requeues in 1000;
        // the error at 1900 retries after 100 again.
        assert_eq!(*passes.lock().unwrap(), [0, 100, 300, 600, 900, 1900, 2000]);
        let s = status_of(&controllers, "publish");
        assert_eq!(s.restarts, 0, "a reconcile error is retried, not a restart");
        assert_eq!(s.state, ControllerState::Running);
        assert_eq!(s.last_error.as_deref(), Some("store unreachable again"));
        let text = metrics_text(&controllers);
        assert_sample(
            &text,
            r#"rivet_controller_reconciles_total{controller="publish",result="error"}"#,
            5.0,
        );
        assert_sample(
            &text,
            r#"rivet_controller_reconciles_total{controller="publish",result="ok"}"#,
            2.0,
        );
        assert_sample(
            &text,
            r#"rivet_controller_reconcile_duration_seconds_count{controller="publish"}"#,
            7.0,
        );
        controllers.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_trigger_cuts_the_error_backoff_short() {
        let controllers = Controllers::new();
        let trigger = Trigger::new();
        let passes = Arc::new(Mutex::new(Vec::new()));
        let p = passes.clone();
        let t0 = tokio::time::Instant::now();
        controllers.reconcile(
            Controller::new("retry")
                .trigger(&trigger)
                .backoff(no_jitter(10_000, 10_000)),
            move || {
                p.lock().unwrap().push(t0.elapsed().as_millis());
                async { Err::<Action, _>("store unreachable") }
            },
        );
        controllers.wait_outcomes("retry", 1).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        trigger.trigger();
        controllers.wait_outcomes("retry", 2).await;
        assert_eq!(
            *passes.lock().unwrap(),
            [0, 500],
            "retried at the trigger, not after 10 s"
        );
        controllers.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_reconcile_that_panics_runs_again_and_the_trigger_wakes_an_idle_one() {
        let controllers = Controllers::new();
        let trigger = Trigger::new();
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        controllers.reconcile(
            Controller::new("sync").trigger(&trigger).backoff(no_jitter(10, 10)),
            move || {
                let n = c.fetch_add(1, Ordering::SeqCst);
                async move {
                    assert!(n != 0, "first pass blew up");
                    Ok::<_, String>(Action::await_change())
                }
            },
        );
        controllers.wait_outcomes("sync", 2).await;
        let s = status_of(&controllers, "sync");
        assert_eq!((s.restarts, s.state), (1, ControllerState::Running));
        assert!(s.last_error.unwrap().contains("first pass blew up"));
        // Idle now: nothing runs however long we wait, until triggered.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        trigger.trigger();
        controllers.wait_outcomes("sync", 3).await;
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        let text = metrics_text(&controllers);
        assert_sample(
            &text,
            r#"rivet_controller_restarts_total{controller="sync",reason="panic"}"#,
            1.0,
        );
        controllers.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_cancels_every_controller_and_waits_for_them() {
        let controllers = Controllers::new();
        let calls = Arc::new(Calls::default());
        let c = calls.clone();
        controllers.supervise(Controller::new("forever"), move |progress| {
            let guard = DropGuard(c.clone());
            c.started.fetch_add(1, Ordering::SeqCst);
            async move {
                let _guard = guard;
                progress.ok();
                std::future::pending::<Result<(), String>>().await
            }
        });
        let c = calls.clone();
        controllers.reconcile(Controller::new("periodic"), move || {
            let guard = DropGuard(c.clone());
            c.started.fetch_add(1, Ordering::SeqCst);
            async move {
                let _guard = guard;
                Ok::<_, String>(Action::requeue(Duration::from_millis(10)))
            }
        });
        controllers.wait_outcomes("forever", 1).await;
        controllers.wait_outcomes("periodic", 3).await;
        controllers.shutdown().await;
        let started = calls.started.load(Ordering::SeqCst);
        assert_eq!(
            calls.dropped.load(Ordering::SeqCst),
            started,
            "every run was dropped by the time shutdown returned"
        );
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(
            calls.started.load(Ordering::SeqCst),
            started,
            "nothing runs after shutdown"
        );
        assert!(
            controllers.status().iter().all(|s| s.state == ControllerState::Stopped),
            "{:?}",
            controllers.status()
        );
        // Started after shutdown: never runs.
        controllers.reconcile(Controller::new("late"), || async { Ok::<_, String>(Action::done()) });
        controllers.shutdown().await;
        assert_eq!(status_of(&controllers, "late").state, ControllerState::Stopped);
    }

    #[tokio::test(start_paused = true)]
    async fn a_controller_failing_longer_than_allowed_degrades_the_daemon_until_it_recovers() {
        let controllers = Controllers::new();
        let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let h = healthy.clone();
        controllers.reconcile(
            Controller::new("store-watch")
                .backoff(no_jitter(1000, 1000))
                .degraded_after(Duration::from_secs(5)),
            move || {
                let ok = h.load(Ordering::SeqCst);
                async move {
                    if ok {
                        Ok(Action::await_change())
                    } else {
                        Err("etcd: connection refused")
                    }
                }
            },
        );
        controllers.wait_outcomes("store-watch", 3).await;
        assert!(status_of(&controllers, "store-watch").failing());
        assert_eq!(controllers.degraded(), None, "failing for 2 s of the 5 allowed");
        controllers.wait_outcomes("store-watch", 7).await;
        let reason = controllers.degraded().expect("failing for 6 s");
        assert!(
            reason.starts_with("controller store-watch failing for 6s: etcd: connection refused"),
            "{reason}"
        );
        let proto = status_of(&controllers, "store-watch").to_proto();
        assert!(proto.degraded);
        assert_eq!(proto.state, pb::ControllerState::Failing as i32);
        assert_eq!(proto.last_success_age_ms, None);
        assert_eq!(proto.failing_for_ms, Some(6000));
        healthy.store(true, Ordering::SeqCst);
        controllers.wait_outcomes("store-watch", 8).await;
        assert_eq!(controllers.degraded(), None);
        assert_eq!(status_of(&controllers, "store-watch").to_proto().failing_for_ms, None);
        controllers.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_child_set_is_shown_with_its_parent_cancelled_by_it_and_stopped_when_dropped() {
        let daemon = Controllers::new();
        let calls = Arc::new(Calls::default());
        let start = |set: &Controllers| {
            let c = calls.clone();
            set.supervise(Controller::new("lease-keeper"), move |progress| {
                let guard = DropGuard(c.clone());
                c.started.fetch_add(1, Ordering::SeqCst);
                async move {
                    let _guard = guard;
                    progress.ok();
                    std::future::pending::<Result<(), String>>().await
                }
            });
        };
        let component = daemon.child();
        start(&component);
        daemon.wait_outcomes("lease-keeper", 1).await;
        assert_eq!(daemon.status().len(), 1, "the parent shows its child's controllers");
        assert_sample(
            &metrics_text(&daemon),
            r#"rivet_controller_failing{controller="lease-keeper"}"#,
            0.0,
        );
        drop(component);
        tokio::task::yield_now().await;
        assert!(daemon.status().is_empty(), "{:?}", daemon.status());
        assert_eq!(
            calls.dropped.load(Ordering::SeqCst),
            1,
            "dropping the child stopped its loop"
        );
        // Made again under the same name; the parent's shutdown cancels it.
        let component = daemon.child();
        start(&component);
        daemon.wait_outcomes("lease-keeper", 1).await;
        daemon.shutdown().await;
        tokio::task::yield_now().await;
        assert_eq!(
            calls.dropped.load(Ordering::SeqCst),
            2,
            "the parent's shutdown cancelled the child"
        );
        drop(component);
    }

    #[test]
    #[should_panic(expected = "started twice")]
    fn names_are_unique() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let controllers = Controllers::new();
            controllers.reconcile(Controller::new("a"), || async { Ok::<_, String>(Action::done()) });
            controllers.reconcile(Controller::new("a"), || async { Ok::<_, String>(Action::done()) });
        });
    }
}
