//! The collector: a full pass at start, then passes on the adaptive interval
//! ([`crate::interval`]), early on RunNow or map pressure. Passes run one at a
//! time on a blocking thread, scheduled by the controller `gc-passes`
//! (`rivet_common::controller`); a pass that could open no map is retried
//! after [`CollectorOptions::retry`], doubling up to the interval's upper
//! bound. The controller `gc-map-pressure` checks the maps' fill.
//!
//! RunNow: a caller waits for the first pass that *starts* after its call
//! began (a pass already running is finished first); callers arriving
//! together share that pass.
//!
//! Map pressure: every `pressure_check` the fill of each map is estimated
//! from a sample ([`EntryMap::estimate_len`](crate::map::EntryMap)); one at
//! or above `pressure_threshold` of max_entries starts a pass early, but not
//! sooner than the minimum interval after the previous pass started (live
//! entries alone may be above the threshold; an LRU map then evicts the least
//! recently used).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rivet_common::backoff::Backoff;
use rivet_common::controller::{Action, Controller, Controllers, Trigger as Wake};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::classify::{CtRules, LocalEndpoints, Timeouts};
use crate::clock::Clock;
use crate::endpoints::{EndpointList, EndpointSource};
use crate::events::{self, GcMetrics};
use crate::interval::{IntervalBounds, next_interval};
use crate::pass::{DeletedCounts, GcMaps, OrphanCheck, PassError, PassPlan, PassReport, Trigger, run_pass};

/// Results of recent passes kept for RunNow callers.
const RECENT: usize = 16;

/// How the collector schedules and what it applies.
#[derive(Clone, Debug)]
pub struct CollectorOptions {
    /// Idle timeouts.
    pub timeouts: Timeouts,
    /// The interval after the initial pass, before adaptation.
    pub start_interval: Duration,
    /// Bounds of the adaptive interval.
    pub bounds: IntervalBounds,
    /// Fill (share of max_entries) that starts a pass early; ≥ 1 disables.
    pub pressure_threshold: f64,
    /// How often the fill is estimated.
    pub pressure_check: Duration,
    /// Delay before retrying a pass that could open no map (doubling while
    /// it keeps failing, up to the interval's upper bound).
    pub retry: Duration,
}

impl Default for CollectorOptions {
    fn default() -> Self {
        Self {
            timeouts: Timeouts::default(),
            start_interval: Duration::from_secs(300),
            bounds: IntervalBounds {
                min: Duration::from_secs(10),
                max: Duration::from_secs(1800),
            },
            pressure_threshold: 0.8,
            pressure_check: Duration::from_secs(5),
            retry: Duration::from_secs(2),
        }
    }
}

/// Totals of one map since start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapTotals {
    /// Entries read.
    pub scanned: u64,
    /// Entries deleted, by reason.
    pub deleted: DeletedCounts,
    /// Entries spared because they were refreshed.
    pub spared_refreshed: u64,
}

/// What `Status` reports.
#[derive(Clone, Debug)]
pub struct CollectorStatus {
    /// The last completed pass.
    pub last_pass: Option<PassReport>,
    /// A pass is running.
    pub pass_running: bool,
    /// When the next scheduled pass starts (Unix nanoseconds).
    pub next_pass_unix_nanos: i64,
    /// The current interval.
    pub interval: Duration,
    /// Its bounds.
    pub bounds: IntervalBounds,
    /// Passes completed.
    pub passes: u64,
    /// Map-pressure checks that estimated the fill (those held back by the
    /// minimum interval are not counted): a pass the fill called for starts
    /// before the next one, so tests wait on this instead of sleeping.
    pub fill_checks: u64,
    /// Per map, in sweep order.
    pub totals: Vec<(String, MapTotals)>,
    /// The timeouts applied.
    pub timeouts: Timeouts,
}

/// Why RunNow returned without a pass.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RunNowError {
    /// The pass could not open any map.
    #[error(transparent)]
    Pass(#[from] PassError),
    /// The deadline passed first; the pass goes on.
    #[error("the pass did not finish within {0:?}; it continues and shows in Status")]
    DeadlineExceeded(Duration),
    /// The collector stopped.
    #[error("the collector stopped")]
    Stopped,
}

struct State {
    interval: Duration,
    next_pass: Instant,
    running: Option<u64>,
    started: u64,
    run_now: bool,
    last_start: Option<Instant>,
    last_pass: Option<PassReport>,
    passes: u64,
    fill_checks: u64,
    /// A pressure check asked for a pass.
    pressure: bool,
    recent: VecDeque<(u64, Result<PassReport, PassError>)>,
    totals: BTreeMap<String, MapTotals>,
}

struct Inner {
    opts: CollectorOptions,
    maps: Arc<Mutex<GcMaps>>,
    map_names: Vec<String>,
    endpoints: Arc<dyn EndpointSource>,
    clock: Arc<dyn Clock>,
    metrics: GcMetrics,
    state: Mutex<State>,
    wake: Wake,
    finished: watch::Sender<u64>,
}

/// The collector; cheap to clone. [`start`](Self::start) spawns its loop.
#[derive(Clone)]
pub struct Collector {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collector")
            .field("opts", &self.inner.opts)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind: keep going.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Collector {
    /// A collector over `maps`; nothing runs until [`start`](Self::start).
    pub fn new(
        opts: CollectorOptions,
        maps: GcMaps,
        endpoints: Arc<dyn EndpointSource>,
        clock: Arc<dyn Clock>,
        metrics: GcMetrics,
    ) -> Self {
        let map_names = maps.names();
        let interval = opts
            .start_interval
            .clamp(opts.bounds.min, opts.bounds.max.max(opts.bounds.min));
        let totals = map_names.iter().map(|n| (n.clone(), MapTotals::default())).collect();
        Self {
            inner: Arc::new(Inner {
                opts,
                maps: Arc::new(Mutex::new(maps)),
                map_names,
                endpoints,
                clock,
                metrics,
                state: Mutex::new(State {
                    interval,
                    next_pass: Instant::now(),
                    running: None,
                    started: 0,
                    run_now: false,
                    last_start: None,
                    last_pass: None,
                    passes: 0,
                    fill_checks: 0,
                    pressure: false,
                    recent: VecDeque::new(),
                    totals,
                }),
                wake: Wake::new(),
                finished: watch::channel(0).0,
            }),
        }
    }

    /// Starts the passes (the initial pass at once; controller `gc-passes`)
    /// and the map-pressure checks (`gc-map-pressure`) under `controllers`.
    pub fn start(&self, controllers: &Controllers) {
        let opts = &self.inner.opts;
        let retry = Backoff::new(opts.retry, opts.bounds.max.max(opts.retry)).with_jitter(0.0);
        let passes = Controller::new("gc-passes").trigger(&self.inner.wake).backoff(retry);
        let inner = self.inner.clone();
        controllers.reconcile(passes, move || inner.clone().scheduled_pass());
        if opts.pressure_threshold < 1.0 && !opts.pressure_check.is_zero() {
            let inner = self.inner.clone();
            // The first check one period after the start, as every later one.
            let mut first = true;
            controllers.reconcile(Controller::new("gc-map-pressure"), move || {
                let (inner, check) = (inner.clone(), !std::mem::replace(&mut first, false));
                async move {
                    if check && inner.under_pressure().await {
                        lock(&inner.state).pressure = true;
                        inner.wake.trigger();
                    }
                    Ok::<_, std::convert::Infallible>(Action::requeue(inner.opts.pressure_check))
                }
            });
        }
    }

    /// Waits for the first pass that starts after this call (see the module
    /// docs), at most `deadline`.
    pub async fn run_now(&self, deadline: Duration) -> Result<PassReport, RunNowError> {
        let target = {
            let mut state = lock(&self.inner.state);
            state.run_now = true;
            state.running.map_or(state.started + 1, |n| n + 1)
        };
        self.inner.wake.trigger();
        let mut finished = self.inner.finished.subscribe();
        match tokio::time::timeout(deadline, finished.wait_for(|n| *n >= target)).await {
            Err(_) => return Err(RunNowError::DeadlineExceeded(deadline)),
            Ok(Err(_)) => return Err(RunNowError::Stopped),
            Ok(Ok(_)) => {}
        }
        let state = lock(&self.inner.state);
        let found = state.recent.iter().find(|(n, _)| *n >= target).map(|(_, r)| r.clone());
        match found {
            Some(result) => result.map_err(RunNowError::from),
            // Older than RECENT passes ago: report the latest.
            None => state.last_pass.clone().ok_or(RunNowError::Stopped),
        }
    }

    /// The current status.
    pub fn status(&self) -> CollectorStatus {
        let state = lock(&self.inner.state);
        let until_next = state.next_pass.saturating_duration_since(Instant::now());
        let next_pass_unix_nanos = self
            .inner
            .clock
            .unix_nanos()
            .saturating_add(i64::try_from(until_next.as_nanos()).unwrap_or(i64::MAX));
        CollectorStatus {
            last_pass: state.last_pass.clone(),
            pass_running: state.running.is_some(),
            next_pass_unix_nanos,
            interval: state.interval,
            bounds: self.inner.opts.bounds,
            passes: state.passes,
            fill_checks: state.fill_checks,
            totals: self
                .inner
                .map_names
                .iter()
                .map(|n| (n.clone(), state.totals.get(n).cloned().unwrap_or_default()))
                .collect(),
            timeouts: self.inner.opts.timeouts,
        }
    }
}

impl Inner {
    /// One pass, for the reason that woke it; the next when the adaptive
    /// interval says (or earlier, when woken).
    async fn scheduled_pass(self: Arc<Self>) -> Result<Action, PassError> {
        let trigger = {
            let mut state = lock(&self.state);
            if state.run_now {
                Trigger::RunNow
            } else if std::mem::take(&mut state.pressure) {
                Trigger::MapPressure
            } else if state.passes == 0 {
                // Until one pass completed (maps not pinned yet), a retry is
                // still the initial pass.
                Trigger::Initial
            } else {
                Trigger::Interval
            }
        };
        self.pass(trigger).await?;
        let next = lock(&self.state).next_pass;
        Ok(Action::requeue(next.saturating_duration_since(Instant::now())))
    }

    async fn plan(&self, number: u64, trigger: Trigger) -> PassPlan {
        // Taken before asking: an endpoint listed after this instant cannot
        // have entries refreshed before it (see `classify`).
        let listed_at = self.clock.monotonic_nanos();
        let list = self.endpoints.list().await;
        let (orphan_check, endpoints) = match list {
            EndpointList::Complete(addrs) if addrs.is_empty() => (OrphanCheck::SkippedListEmpty, None),
            EndpointList::Complete(addrs) => (OrphanCheck::Done, Some(LocalEndpoints { addrs, listed_at })),
            EndpointList::Restoring => (OrphanCheck::SkippedRestoring, None),
            EndpointList::Failed(error) => {
                tracing::debug!(pass = number, "endpoint list unavailable, no orphan deletion: {error}");
                (OrphanCheck::SkippedListFailed, None)
            }
        };
        PassPlan {
            number,
            trigger,
            rules: CtRules {
                timeouts: self.opts.timeouts,
                endpoints,
            },
            orphan_check,
        }
    }

    async fn pass(&self, trigger: Trigger) -> Result<(), PassError> {
        let number = {
            let mut state = lock(&self.state);
            state.started += 1;
            state.running = Some(state.started);
            state.run_now = false;
            state.started
        };
        let started = Instant::now();
        let plan = self.plan(number, trigger).await;
        let maps = self.maps.clone();
        let clock = self.clock.clone();
        let result = tokio::task::spawn_blocking(move || run_pass(&mut lock(&maps), &plan, clock.as_ref()))
            .await
            .unwrap_or_else(|e| {
                tracing::error!(pass = number, error = %e, "the pass panicked");
                Err(PassError::Panicked { pass: number })
            });
        {
            let mut state = lock(&self.state);
            match &result {
                Ok(report) => {
                    let elapsed = state.last_start.map_or(Duration::ZERO, |t| started.duration_since(t));
                    state.interval = next_interval(state.interval, report.delete_ratio, elapsed, self.opts.bounds);
                    state.next_pass = started + state.interval;
                    state.last_start = Some(started);
                    state.passes += 1;
                    for map in &report.maps {
                        let totals = state.totals.entry(map.map.clone()).or_default();
                        totals.scanned += map.scanned;
                        totals.deleted.add(&map.deleted);
                        totals.spared_refreshed += map.spared_refreshed;
                    }
                    state.last_pass = Some(report.clone());
                    events::pass_completed(&self.metrics, report, state.interval);
                }
                Err(error) => events::pass_failed(&self.metrics, number, trigger, error),
            }
            state.recent.push_back((number, result.clone()));
            while state.recent.len() > RECENT {
                state.recent.pop_front();
            }
            state.running = None;
        }
        self.finished.send_replace(number);
        result.map(|_| ())
    }

    /// Estimates every map's fill; true when one is at the threshold and the
    /// minimum interval has passed since the last pass started.
    async fn under_pressure(&self) -> bool {
        let since_last = lock(&self.state).last_start.map(|t| t.elapsed());
        if since_last.is_some_and(|d| d < self.opts.bounds.min) {
            return false;
        }
        let maps = self.maps.clone();
        let fills = tokio::task::spawn_blocking(move || {
            let mut maps = lock(&maps);
            let mut out = Vec::new();
            if let Ok(m) = maps.ct4.get() {
                out.push((m.name().to_owned(), m.estimate_len(), m.max_entries()));
            }
            if let Ok(m) = maps.ct6.get() {
                out.push((m.name().to_owned(), m.estimate_len(), m.max_entries()));
            }
            if let Some(services) = &mut maps.services {
                for (name, estimate, max) in services.flow_fills() {
                    out.push((name, estimate, max));
                }
            }
            out
        })
        .await
        .unwrap_or_default();
        let mut pressed = false;
        for (name, estimate, max) in fills {
            match estimate {
                Ok(n) => {
                    events::map_fill(&self.metrics, &name, n, max, self.opts.pressure_threshold);
                    pressed |= max > 0 && n as f64 >= self.opts.pressure_threshold * f64::from(max);
                }
                Err(e) => tracing::debug!(map = %name, "no fill estimate: {e}"),
            }
        }
        lock(&self.state).fill_checks += 1;
        pressed
    }
}
