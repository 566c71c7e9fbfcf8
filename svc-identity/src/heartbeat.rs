//! The kvstore heartbeat watchdog: rivet-operator's leader writes the time
//! (RFC 3339) at `<prefix>.heartbeat` every `--kvstore-heartbeat-interval`;
//! svc-identity watches the key and reports the kvstore unhealthy when no
//! write was observed for `--kvstore-heartbeat-stale-multiple` intervals
//! (the seed's agents do the same check).
//!
//! Reported, never acted on: the seed's agent declares the kvstore
//! unhealthy and restarts; svc-identity only reports it (GetStatus, `rivet
//! status`, metrics, a log line per transition) and keeps serving from its
//! cache, because traffic must not depend on the kvstore or the operator.
//! It does not make the daemon degraded or not ready either.
//!
//! Ages are measured by svc-identity's own monotonic clock from the moment
//! it observed a write, so clock skew between machines does not matter.
//! The written time is read only when the key is read rather than seen
//! changing (at start and after a reconnect): a key written longer ago than
//! the threshold then is stale at once. An absent key is its own state
//! ([`HeartbeatState::Missing`]: no heartbeat from rivet-operator yet), and
//! counts as unhealthy only once it has been absent for the threshold
//! (from start, or from its deletion).
//!
//! Pieces: [`HeartbeatTracker`] is the pure state (no I/O, every call
//! takes the time); [`HeartbeatWatchdog`] feeds it from an etcd watch (a
//! supervised controller, `kvstore-heartbeat-watch`) and turns its changes
//! into log lines and metrics (a reconcile controller,
//! `kvstore-heartbeat-check`, woken by each event and when the state would
//! turn by itself).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use etcd_client::{Client, EventType, WatchOptions};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Action, Controller, Controllers, Progress, Trigger};
use rivet_proto::identity::v1 as pb;
use tokio::time::Instant;

/// The operator's default `--kvstore-heartbeat-interval` (the seed's: 1 min).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);
/// Default `--kvstore-heartbeat-stale-multiple`.
pub const DEFAULT_STALE_MULTIPLE: u32 = 2;
/// Bound of the read at (re)connect.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// svc-identity's heartbeat flags (etcd store only).
#[derive(Debug, Clone, clap::Args)]
pub struct HeartbeatArgs {
    /// How often rivet-operator writes the kvstore heartbeat (its
    /// `--kvstore-heartbeat-interval`; `30s`, `1m`, ...).
    #[arg(long, env = "RIVET_KVSTORE_HEARTBEAT_INTERVAL", default_value = "1m",
          value_parser = parse_interval)]
    pub kvstore_heartbeat_interval: Duration,

    /// The heartbeat is stale (the kvstore reported unhealthy, nothing
    /// else changes) when no write was observed for this many intervals.
    #[arg(long, env = "RIVET_KVSTORE_HEARTBEAT_STALE_MULTIPLE", default_value_t = DEFAULT_STALE_MULTIPLE,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub kvstore_heartbeat_stale_multiple: u32,
}

/// A positive duration flag (`1m`, `500ms`): `--kvstore-heartbeat-interval`
/// here and in rivet-operator, which also parses its kvstore flags with it
/// (zero would make a pass loop without pause).
///
/// ```
/// use std::time::Duration;
/// use svc_identity::heartbeat::parse_interval;
/// assert_eq!(parse_interval("1m"), Ok(Duration::from_secs(60)));
/// assert!(parse_interval("0s").is_err());
/// ```
pub fn parse_interval(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if d.is_zero() => Err("must be more than zero".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

impl HeartbeatArgs {
    /// How long without an observed write makes the heartbeat stale.
    pub fn threshold(&self) -> Duration {
        self.kvstore_heartbeat_interval
            .saturating_mul(self.kvstore_heartbeat_stale_multiple)
    }
}

/// The heartbeat as svc-identity sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeartbeatState {
    /// A write was observed less than the threshold ago.
    Fresh,
    /// No write observed for the threshold (or, read at (re)connect, the
    /// written time was already older than that).
    Stale,
    /// The key does not exist: no heartbeat from rivet-operator (yet).
    Missing,
    /// The store has no heartbeat (embedded or kubernetes store).
    NotApplicable,
}

impl HeartbeatState {
    /// Lower case, for logs, metrics and `rivet status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fresh => "fresh",
            Self::Stale => "stale",
            Self::Missing => "missing",
            Self::NotApplicable => "not_applicable",
        }
    }

    fn to_proto(self) -> pb::KvstoreHeartbeatState {
        match self {
            Self::Fresh => pb::KvstoreHeartbeatState::Fresh,
            Self::Stale => pb::KvstoreHeartbeatState::Stale,
            Self::Missing => pb::KvstoreHeartbeatState::Missing,
            Self::NotApplicable => pb::KvstoreHeartbeatState::NotApplicable,
        }
    }
}

/// A report of the heartbeat at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatReport {
    /// The state.
    pub state: HeartbeatState,
    /// Fresh, or missing for less than the threshold.
    pub healthy: bool,
    /// The time the operator wrote, when it could be read.
    pub last_written: Option<SystemTime>,
    /// Since the last observed write (by this process's clock; plus the
    /// written age when the key was already too old when read).
    pub observed_age: Option<Duration>,
    /// How long without a write makes the heartbeat stale.
    pub threshold: Duration,
}

impl HeartbeatReport {
    /// The report of a store without a heartbeat.
    pub fn not_applicable() -> Self {
        Self {
            state: HeartbeatState::NotApplicable,
            healthy: true,
            last_written: None,
            observed_age: None,
            threshold: Duration::ZERO,
        }
    }

    /// As `GetStatus` sends it.
    pub fn to_proto(&self) -> pb::KvstoreHeartbeat {
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        pb::KvstoreHeartbeat {
            state: self.state.to_proto() as i32,
            healthy: self.healthy,
            last_written_unix_nanos: self
                .last_written
                .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
            observed_age_ms: self.observed_age.map(millis),
            stale_threshold_ms: millis(self.threshold),
        }
    }
}

/// The last write observed.
#[derive(Debug, Clone)]
struct Observed {
    /// The written time, when it parses.
    written: Option<SystemTime>,
    mod_revision: i64,
    at: Instant,
    /// Added to the age: the written age when the key was read (not seen
    /// changing) already older than the threshold.
    age_at_arrival: Duration,
}

/// The heartbeat's state, fed by reads and watch events; pure (every call
/// takes the time), so it is tested without a clock or etcd.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use svc_identity::heartbeat::{HeartbeatState, HeartbeatTracker};
/// use tokio::time::Instant;
///
/// let start = Instant::now();
/// let mut t = HeartbeatTracker::new(Duration::from_secs(120), start);
/// assert_eq!(t.report(start).state, HeartbeatState::Missing);
/// t.written("2026-11-26T06:00:00Z", 7, start);
/// assert_eq!(t.report(start + Duration::from_secs(119)).state, HeartbeatState::Fresh);
/// assert_eq!(t.report(start + Duration::from_secs(120)).state, HeartbeatState::Stale);
/// ```
#[derive(Debug, Clone)]
pub struct HeartbeatTracker {
    threshold: Duration,
    /// Since when the key is absent (start, or its deletion).
    missing_since: Instant,
    observed: Option<Observed>,
}

impl HeartbeatTracker {
    /// Nothing observed yet, as of `now` (the start).
    pub fn new(threshold: Duration, now: Instant) -> Self {
        Self {
            threshold,
            missing_since: now,
            observed: None,
        }
    }

    /// The key as read at `now` (at start or after a reconnect): `None`
    /// when absent, else its value and mod revision. A revision already
    /// observed changes nothing; a new one counts as a write observed now,
    /// unless its written time (by `wall_now`) is older than the threshold
    /// or cannot be read: then it is stale at once.
    pub fn read(&mut self, key: Option<(&str, i64)>, now: Instant, wall_now: SystemTime) {
        let Some((value, mod_revision)) = key else {
            self.deleted(now);
            return;
        };
        if self.observed.as_ref().is_some_and(|o| o.mod_revision == mod_revision) {
            return;
        }
        let written = parse_time(value);
        let written_age = match written {
            Some(t) => wall_now.duration_since(t).unwrap_or(Duration::ZERO),
            None => self.threshold,
        };
        self.observed = Some(Observed {
            written,
            mod_revision,
            at: now,
            age_at_arrival: if written_age >= self.threshold {
                written_age
            } else {
                Duration::ZERO
            },
        });
    }

    /// A write seen by the watch at `now`: fresh, whatever time it holds.
    pub fn written(&mut self, value: &str, mod_revision: i64, now: Instant) {
        self.observed = Some(Observed {
            written: parse_time(value),
            mod_revision,
            at: now,
            age_at_arrival: Duration::ZERO,
        });
    }

    /// The key is gone (deleted, or absent when read) as of `now`.
    pub fn deleted(&mut self, now: Instant) {
        if self.observed.take().is_some() {
            self.missing_since = now;
        }
    }

    /// The heartbeat at `now`.
    pub fn report(&self, now: Instant) -> HeartbeatReport {
        let (state, healthy, last_written, observed_age) = match &self.observed {
            None => {
                let healthy = now.saturating_duration_since(self.missing_since) < self.threshold;
                (HeartbeatState::Missing, healthy, None, None)
            }
            Some(o) => {
                let age = o.age_at_arrival + now.saturating_duration_since(o.at);
                let fresh = age < self.threshold;
                let state = if fresh {
                    HeartbeatState::Fresh
                } else {
                    HeartbeatState::Stale
                };
                (state, fresh, o.written, Some(age))
            }
        };
        HeartbeatReport {
            state,
            healthy,
            last_written,
            observed_age,
            threshold: self.threshold,
        }
    }

    /// How long after `now` the report turns by itself (fresh → stale,
    /// missing → unhealthy), if it does.
    pub fn turns_in(&self, now: Instant) -> Option<Duration> {
        let report = self.report(now);
        let elapsed = match report.state {
            HeartbeatState::Fresh => report.observed_age?,
            HeartbeatState::Missing if report.healthy => now.saturating_duration_since(self.missing_since),
            _ => return None,
        };
        Some(self.threshold.saturating_sub(elapsed))
    }
}

/// The operator's RFC 3339 time (UTC, `Z`, any fraction of a second).
fn parse_time(value: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(value.trim()).ok()
}

/// Why a run of the heartbeat watch ended (its controller starts it again).
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// An etcd request failed.
    #[error("{action} {key}: {source}")]
    Etcd {
        /// What was being done.
        action: &'static str,
        /// The heartbeat key.
        key: String,
        /// etcd-client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// The read did not answer in time.
    #[error("reading {key}: no answer within {timeout:?}")]
    Timeout {
        /// The heartbeat key.
        key: String,
        /// The bound.
        timeout: Duration,
    },
    /// etcd ended or cancelled the watch.
    #[error("watching {key}: {reason}")]
    Ended {
        /// The heartbeat key.
        key: String,
        /// What etcd said.
        reason: String,
    },
}

#[derive(Debug)]
struct Shared {
    tracker: Mutex<HeartbeatTracker>,
    /// The last (state, healthy) logged.
    logged: Mutex<Option<(HeartbeatState, bool)>>,
    transitions: Family<StateLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
    healthy: &'static str,
}

/// Watches the heartbeat key and reports it; cheap to clone.
#[derive(Debug, Clone)]
pub struct HeartbeatWatchdog {
    key: String,
    shared: Arc<Shared>,
    changed: Trigger,
}

impl HeartbeatWatchdog {
    /// A watchdog of `key` with `threshold`, nothing observed yet.
    pub fn new(key: String, threshold: Duration) -> Self {
        Self {
            key,
            shared: Arc::new(Shared {
                tracker: Mutex::new(HeartbeatTracker::new(threshold, Instant::now())),
                logged: Mutex::new(None),
                transitions: Family::default(),
            }),
            changed: Trigger::new(),
        }
    }

    fn tracker(&self) -> MutexGuard<'_, HeartbeatTracker> {
        self.shared.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The heartbeat now.
    pub fn report(&self) -> HeartbeatReport {
        self.tracker().report(Instant::now())
    }

    /// Starts watching over `client` (`kvstore-heartbeat-watch`) and
    /// reporting (`kvstore-heartbeat-check`) on `controllers`.
    pub fn run(&self, client: Client, controllers: &Controllers) {
        let watchdog = self.clone();
        // Reported, never acted on: a failing heartbeat watch does not make
        // svc-identity degraded (the identity watch reports etcd itself).
        let watch = Controller::new("kvstore-heartbeat-watch")
            .backoff(Backoff::new(Duration::from_millis(200), Duration::from_secs(5)))
            .degraded_after(Duration::MAX);
        controllers.supervise(watch, move |progress| {
            let (watchdog, client) = (watchdog.clone(), client.clone());
            async move { watchdog.watch(client, progress).await }
        });
        let watchdog = self.clone();
        let check = Controller::new("kvstore-heartbeat-check").trigger(&self.changed);
        controllers.reconcile(check, move || {
            let watchdog = watchdog.clone();
            async move { Ok::<_, std::convert::Infallible>(watchdog.check()) }
        });
    }

    /// One run of the watch: read the key (a write made while disconnected
    /// is seen here), then follow its changes from that revision.
    async fn watch(&self, mut client: Client, progress: Progress) -> Result<(), WatchError> {
        let etcd = |action: &'static str| {
            let key = self.key.clone();
            move |source| WatchError::Etcd { action, key, source }
        };
        let read = tokio::time::timeout(READ_TIMEOUT, client.get(self.key.as_str(), None))
            .await
            .map_err(|_| WatchError::Timeout {
                key: self.key.clone(),
                timeout: READ_TIMEOUT,
            })?
            .map_err(etcd("reading"))?;
        let revision = read.header().map_or(0, |h| h.revision());
        {
            let kv = read.kvs().first();
            let key = kv.map(|kv| (kv.value_str().unwrap_or(""), kv.mod_revision()));
            self.tracker().read(key, Instant::now(), SystemTime::now());
        }
        self.changed.trigger();
        let options = WatchOptions::new().with_start_revision(revision + 1);
        let mut stream = client
            .watch(self.key.as_str(), Some(options))
            .await
            .map_err(etcd("watching"))?;
        progress.ok();
        loop {
            let Some(resp) = stream.message().await.map_err(etcd("watching"))? else {
                return Err(self.ended("etcd closed the watch stream".into()));
            };
            if resp.canceled() {
                return Err(self.ended(format!("etcd cancelled the watch: {}", resp.cancel_reason())));
            }
            let now = Instant::now();
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                match event.event_type() {
                    EventType::Put => self
                        .tracker()
                        .written(kv.value_str().unwrap_or(""), kv.mod_revision(), now),
                    EventType::Delete => self.tracker().deleted(now),
                }
            }
            self.changed.trigger();
        }
    }

    fn ended(&self, reason: String) -> WatchError {
        WatchError::Ended {
            key: self.key.clone(),
            reason,
        }
    }

    /// Logs and counts a transition; wakes again when the state would turn
    /// by itself.
    fn check(&self) -> Action {
        let now = Instant::now();
        let (report, turns_in) = {
            let tracker = self.tracker();
            (tracker.report(now), tracker.turns_in(now))
        };
        let current = (report.state, report.healthy);
        let previous = self
            .shared
            .logged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(current);
        if previous != Some(current) {
            transition(&self.shared.transitions, &self.key, previous.map(|p| p.0), &report);
        }
        // A little after the turn, so the pass sees it.
        match turns_in {
            Some(after) => Action::requeue(after + Duration::from_millis(10)),
            None => Action::await_change(),
        }
    }

    /// Registers `rivet_identity_kvstore_heartbeat_age_seconds`,
    /// `rivet_identity_kvstore_healthy` (read at each scrape) and
    /// `rivet_identity_kvstore_heartbeat_transitions_total{state,healthy}`
    /// under `registry` (prefix `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("identity");
        r.register(
            "kvstore_heartbeat_transitions",
            "Changes of the kvstore heartbeat's state as svc-identity observes it, by the new state",
            self.shared.transitions.clone(),
        );
        r.register_collector(Box::new(HeartbeatGauges(self.clone())));
    }
}

/// The event of a transition: its log line and its counter together.
fn transition(
    transitions: &Family<StateLabels, Counter>,
    key: &str,
    from: Option<HeartbeatState>,
    report: &HeartbeatReport,
) {
    transitions
        .get_or_create(&StateLabels {
            state: report.state.as_str(),
            healthy: if report.healthy { "true" } else { "false" },
        })
        .inc();
    let from = from.map_or("unknown", HeartbeatState::as_str);
    let to = report.state.as_str();
    let age_s = report.observed_age.map(|a| a.as_secs_f64());
    let threshold_s = report.threshold.as_secs_f64();
    match (report.state, report.healthy) {
        (HeartbeatState::Fresh, _) => tracing::info!(
            key,
            from,
            to,
            age_s,
            threshold_s,
            "kvstore heartbeat fresh: rivet-operator writes it"
        ),
        (HeartbeatState::Missing, true) => tracing::info!(
            key,
            from,
            to,
            threshold_s,
            "no kvstore heartbeat from rivet-operator yet"
        ),
        (HeartbeatState::Missing, false) => tracing::warn!(
            key,
            from,
            to,
            threshold_s,
            "kvstore unhealthy: no heartbeat from rivet-operator for the threshold; serving from the cache as before"
        ),
        _ => tracing::warn!(
            key,
            from,
            to,
            age_s,
            threshold_s,
            "kvstore unhealthy: heartbeat stale (is rivet-operator running and leading?); serving from the cache as before"
        ),
    }
}

/// The gauges, computed at each scrape.
#[derive(Debug)]
struct HeartbeatGauges(HeartbeatWatchdog);

impl Collector for HeartbeatGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let report = self.0.report();
        if let Some(age) = report.observed_age {
            let gauge = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
            gauge.set(age.as_secs_f64());
            let metric = encoder.encode_descriptor(
                "kvstore_heartbeat_age_seconds",
                "Since svc-identity last observed a write of the kvstore heartbeat (absent while there is none)",
                None,
                gauge.metric_type(),
            )?;
            gauge.encode(metric)?;
        }
        let healthy = Gauge::<i64>::default();
        healthy.set(i64::from(report.healthy));
        let metric = encoder.encode_descriptor(
            "kvstore_healthy",
            "1 while the kvstore heartbeat is fresh (or missing for less than the stale threshold since start), else 0",
            None,
            healthy.metric_type(),
        )?;
        healthy.encode(metric)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THRESHOLD: Duration = Duration::from_secs(120);

    fn at(t0: Instant, secs: u64) -> Instant {
        t0 + Duration::from_secs(secs)
    }

    fn wall(text: &str) -> SystemTime {
        humantime::parse_rfc3339(text).unwrap()
    }

    #[test]
    fn a_missing_key_is_healthy_for_the_threshold_from_start_only() {
        let t0 = Instant::now();
        let mut t = HeartbeatTracker::new(THRESHOLD, t0);
        t.read(None, t0, wall("2026-11-26T06:00:00Z"));
        let r = t.report(at(t0, 119));
        assert_eq!(
            (r.state, r.healthy, r.observed_age),
            (HeartbeatState::Missing, true, None)
        );
        assert_eq!(t.turns_in(at(t0, 100)), Some(Duration::from_secs(20)));
        let r = t.report(at(t0, 120));
        assert_eq!((r.state, r.healthy), (HeartbeatState::Missing, false));
        assert_eq!(t.turns_in(at(t0, 120)), None);
    }

    #[test]
    fn a_watched_write_is_fresh_by_the_local_clock_whatever_time_it_holds() {
        let t0 = Instant::now();
        let mut t = HeartbeatTracker::new(THRESHOLD, t0);
        // Written by a machine whose clock is a day behind: the write
        // itself is the signal.
        t.written("2026-11-25T06:00:00Z", 5, at(t0, 10));
        let r = t.report(at(t0, 129));
        assert_eq!((r.state, r.healthy), (HeartbeatState::Fresh, true));
        assert_eq!(r.observed_age, Some(Duration::from_secs(119)));
        assert_eq!(r.last_written, Some(wall("2026-11-25T06:00:00Z")));
        assert_eq!(t.turns_in(at(t0, 129)), Some(Duration::from_secs(1)));
        let r = t.report(at(t0, 130));
        assert_eq!((r.state, r.healthy), (HeartbeatState::Stale, false));
        // The next write makes it fresh again.
        t.written("2026-11-25T06:03:00Z", 9, at(t0, 200));
        assert_eq!(t.report(at(t0, 200)).state, HeartbeatState::Fresh);
    }

    #[test]
    fn a_key_read_at_start_is_stale_at_once_only_when_older_than_the_threshold() {
        let t0 = Instant::now();
        let now = wall("2026-11-26T06:10:00Z");
        let mut old = HeartbeatTracker::new(THRESHOLD, t0);
        old.read(Some(("2026-11-26T06:07:00Z", 4)), t0, now);
        let r = old.report(t0);
        assert_eq!((r.state, r.healthy), (HeartbeatState::Stale, false));
        assert_eq!(r.observed_age, Some(Duration::from_secs(180)));

        // Written 100 s ago (or by a clock 100 s off): the local clock
        // counts from the read, so skew below the threshold never matters.
        let mut recent = HeartbeatTracker::new(THRESHOLD, t0);
        recent.read(Some(("2026-11-26T06:08:20Z", 4)), t0, now);
        assert_eq!(recent.report(at(t0, 119)).state, HeartbeatState::Fresh);
        // A time in the future is fresh too.
        let mut ahead = HeartbeatTracker::new(THRESHOLD, t0);
        ahead.read(Some(("2026-11-26T07:00:00.5Z", 4)), t0, now);
        assert_eq!(ahead.report(t0).state, HeartbeatState::Fresh);
        // An unreadable time cannot vouch for itself.
        let mut garbage = HeartbeatTracker::new(THRESHOLD, t0);
        garbage.read(Some(("yesterday", 4)), t0, now);
        assert_eq!(garbage.report(t0).state, HeartbeatState::Stale);
    }

    #[test]
    fn a_re_read_of_the_same_revision_keeps_the_observation() {
        let t0 = Instant::now();
        let mut t = HeartbeatTracker::new(THRESHOLD, t0);
        t.written("2026-11-26T06:00:00Z", 5, t0);
        // Reconnected 100 s later: the same revision is no new write.
        t.read(
            Some(("2026-11-26T06:00:00Z", 5)),
            at(t0, 100),
            wall("2026-11-26T06:01:40Z"),
        );
        assert_eq!(t.report(at(t0, 120)).state, HeartbeatState::Stale);
        // A write made while disconnected counts from when it is read.
        t.read(
            Some(("2026-11-26T06:02:00Z", 8)),
            at(t0, 130),
            wall("2026-11-26T06:02:10Z"),
        );
        assert_eq!(t.report(at(t0, 130)).state, HeartbeatState::Fresh);
    }

    #[test]
    fn a_deleted_key_is_missing_and_unhealthy_after_the_threshold_from_its_deletion() {
        let t0 = Instant::now();
        let mut t = HeartbeatTracker::new(THRESHOLD, t0);
        t.written("2026-11-26T06:00:00Z", 5, at(t0, 500));
        t.deleted(at(t0, 510));
        let r = t.report(at(t0, 629));
        assert_eq!((r.state, r.healthy), (HeartbeatState::Missing, true));
        assert!(!t.report(at(t0, 630)).healthy);
    }

    #[test]
    fn the_report_goes_to_the_wire_in_milliseconds_and_unix_nanoseconds() {
        let t0 = Instant::now();
        let mut t = HeartbeatTracker::new(THRESHOLD, t0);
        t.written("2026-11-26T06:00:00.250Z", 5, t0);
        let wire = t.report(at(t0, 3)).to_proto();
        assert_eq!(wire.state, pb::KvstoreHeartbeatState::Fresh as i32);
        assert!(wire.healthy);
        assert_eq!(wire.observed_age_ms, Some(3_000));
        assert_eq!(wire.stale_threshold_ms, 120_000);
        let written = wall("2026-11-26T06:00:00.250Z")
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap();
        assert_eq!(wire.last_written_unix_nanos, written.as_nanos() as i64);
        let none = HeartbeatReport::not_applicable().to_proto();
        assert_eq!(none.state, pb::KvstoreHeartbeatState::NotApplicable as i32);
    }
}
