//! Leader election on a `coordination.k8s.io/v1` Lease: client-go's
//! algorithm (`k8s.io/client-go/tools/leaderelection`), on `Api<Lease>`.
//!
//! - **Acquire**: every retry period, read the Lease. Take it (an update
//!   carrying the read's resourceVersion, so a concurrent taker gets 409) when
//!   it has no holder, when this replica holds it, or when its record has not
//!   changed for the holder's `leaseDurationSeconds` as measured by THIS
//!   replica's monotonic clock since it last saw the record change (no other
//!   machine's clock is trusted). Create it when absent.
//! - **Lead**: a [`Term`] that is valid until `sent + renew deadline`, where
//!   `sent` is the instant BEFORE the winning request was sent; every retry
//!   period the Lease is renewed (again an update with resourceVersion) and
//!   each success extends the term from its own send instant. When no
//!   renewal succeeded within the renew deadline, the term ends and the
//!   replica goes back to acquiring.
//! - **Why no two leaders act at once**: another replica first sees a
//!   renewal after it was written, i.e. after it was sent, and waits the
//!   lease duration from then; the old leader's term is valid only the
//!   renew deadline (shorter) after sending it. A takeover based on a record
//!   that changed in the meantime fails on its resourceVersion.
//! - **Release** ([`Elector::shutdown`]): the term ends, the duties'
//!   controllers stop, then the Lease is written without a holder and with
//!   `leaseDurationSeconds: 1` (client-go's `ReleaseOnCancel`), so the next
//!   replica takes over at its next retry instead of a lease duration later.
//!
//! Each term starts every [`Duty`] on a child set of controllers, shut down
//! when the term ends. The election itself is one reconcile controller
//! ([`CONTROLLER`]) whose pass is one step of the algorithm, requeued every
//! retry period (its error backoff is the retry period too).
//!
//! Not for fencing writes by itself: duties check [`Term::ensure`] right
//! before each write.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Action, Controller, Controllers};
use tokio::sync::watch;

use crate::term::{Duty, Term};

/// The election's controller name (`rivet_controller_*{controller=...}`).
pub const CONTROLLER: &str = "leader-election";

/// The leader-election flags (the seed's cilium-operator's names and
/// defaults).
#[derive(Debug, Clone, clap::Args)]
pub struct LeaderElectionArgs {
    /// How long a Lease holds without renewal: a standby replica takes the
    /// Lease once its record has not changed for this long, as measured by
    /// the standby's own clock since it last saw it change. Must exceed
    /// --leader-election-renew-deadline. Whole seconds (the Lease stores
    /// seconds). A duration: `15s`, `1m`.
    #[arg(
        long,
        env = "RIVET_LEADER_ELECTION_LEASE_DURATION",
        default_value = "15s",
        value_parser = humantime::parse_duration
    )]
    pub leader_election_lease_duration: Duration,

    /// How long the leader keeps acting without a successful renewal: past
    /// this (counted from when the last successful renewal was sent) its
    /// duties stop writing and are shut down, and it competes for the
    /// Lease again. Must exceed --leader-election-retry-period and be
    /// shorter than --leader-election-lease-duration.
    #[arg(
        long,
        env = "RIVET_LEADER_ELECTION_RENEW_DEADLINE",
        default_value = "10s",
        value_parser = humantime::parse_duration
    )]
    pub leader_election_renew_deadline: Duration,

    /// How often the leader renews the Lease and a standby tries to take it
    /// (also the wait after a failed attempt).
    #[arg(
        long,
        env = "RIVET_LEADER_ELECTION_RETRY_PERIOD",
        default_value = "2s",
        value_parser = humantime::parse_duration
    )]
    pub leader_election_retry_period: Duration,

    /// Namespace of the Lease.
    #[arg(long, env = "RIVET_LEADER_ELECTION_NAMESPACE", default_value = "kube-system")]
    pub leader_election_namespace: String,

    /// Name of the Lease every replica competes for.
    #[arg(long, env = "RIVET_LEADER_ELECTION_LEASE_NAME", default_value = "rivet-operator")]
    pub leader_election_lease_name: String,

    /// This replica's identity in the Lease's holderIdentity (default: the
    /// hostname, `_`, a random UUID, as client-go; unique per process start,
    /// so a restarted replica never mistakes its predecessor's lease for
    /// its own).
    #[arg(long, env = "RIVET_LEADER_ELECTION_IDENTITY")]
    pub leader_election_identity: Option<String>,
}

impl LeaderElectionArgs {
    /// The checked election settings; `random_suffix` completes the default
    /// identity (a per-process UUID).
    pub fn config(&self, random_suffix: &str) -> Result<ElectionConfig, InvalidElection> {
        let config = ElectionConfig {
            namespace: self.leader_election_namespace.clone(),
            lease_name: self.leader_election_lease_name.clone(),
            identity: self
                .leader_election_identity
                .clone()
                .unwrap_or_else(|| format!("{}_{random_suffix}", rivet_common::config::hostname())),
            lease_duration: self.leader_election_lease_duration,
            renew_deadline: self.leader_election_renew_deadline,
            retry_period: self.leader_election_retry_period,
        };
        config.validate()?;
        Ok(config)
    }
}

/// The election's settings; see [`LeaderElectionArgs`] for each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionConfig {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub lease_name: String,
    /// This replica's `holderIdentity`.
    pub identity: String,
    /// How long an unrenewed Lease holds.
    pub lease_duration: Duration,
    /// How long a leader acts after its last successful renewal was sent.
    pub renew_deadline: Duration,
    /// The period of renewals and acquisition attempts.
    pub retry_period: Duration,
}

/// Why election settings were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidElection {
    /// The renew deadline is not shorter than the lease duration.
    #[error(
        "--leader-election-renew-deadline ({renew_deadline:?}) must be shorter than --leader-election-lease-duration ({lease_duration:?}): a leader that cannot renew must stop acting before another replica may take the Lease"
    )]
    RenewDeadlineNotBelowLeaseDuration {
        /// The renew deadline.
        renew_deadline: Duration,
        /// The lease duration.
        lease_duration: Duration,
    },
    /// The retry period is not shorter than the renew deadline.
    #[error(
        "--leader-election-retry-period ({retry_period:?}) must be shorter than --leader-election-renew-deadline ({renew_deadline:?}): a leader must get another renewal attempt before its deadline"
    )]
    RetryPeriodNotBelowRenewDeadline {
        /// The retry period.
        retry_period: Duration,
        /// The renew deadline.
        renew_deadline: Duration,
    },
    /// The lease duration is not a whole number of seconds >= 1.
    #[error(
        "--leader-election-lease-duration ({0:?}) must be a whole number of seconds, at least 1s (the Lease stores seconds)"
    )]
    LeaseDurationNotWholeSeconds(Duration),
    /// The retry period is zero.
    #[error("--leader-election-retry-period must be more than 0")]
    ZeroRetryPeriod,
    /// The identity, namespace or lease name is empty.
    #[error("--leader-election-{0} must not be empty")]
    Empty(&'static str),
}

impl ElectionConfig {
    /// Checks retry period < renew deadline < lease duration (client-go's
    /// rule) and the rest.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rivet_operator::leader::ElectionConfig;
    /// let mut config = ElectionConfig {
    ///     namespace: "kube-system".into(),
    ///     lease_name: "rivet-operator".into(),
    ///     identity: "host_1".into(),
    ///     lease_duration: Duration::from_secs(15),
    ///     renew_deadline: Duration::from_secs(10),
    ///     retry_period: Duration::from_secs(2),
    /// };
    /// assert!(config.validate().is_ok());
    /// config.renew_deadline = Duration::from_secs(15);
    /// assert!(config.validate().is_err(), "renew deadline must be below the lease duration");
    /// ```
    pub fn validate(&self) -> Result<(), InvalidElection> {
        for (flag, value) in [
            ("identity", &self.identity),
            ("namespace", &self.namespace),
            ("lease-name", &self.lease_name),
        ] {
            if value.is_empty() {
                return Err(InvalidElection::Empty(flag));
            }
        }
        if self.lease_duration.subsec_nanos() != 0 || self.lease_duration.is_zero() {
            return Err(InvalidElection::LeaseDurationNotWholeSeconds(self.lease_duration));
        }
        if self.retry_period.is_zero() {
            return Err(InvalidElection::ZeroRetryPeriod);
        }
        if self.renew_deadline >= self.lease_duration {
            return Err(InvalidElection::RenewDeadlineNotBelowLeaseDuration {
                renew_deadline: self.renew_deadline,
                lease_duration: self.lease_duration,
            });
        }
        if self.retry_period >= self.renew_deadline {
            return Err(InvalidElection::RetryPeriodNotBelowRenewDeadline {
                retry_period: self.retry_period,
                renew_deadline: self.renew_deadline,
            });
        }
        Ok(())
    }

    fn lease_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }
}

/// A Lease call that failed.
#[derive(Debug, thiserror::Error)]
#[error("{action} Lease {lease} ({kind}): {cause}")]
pub struct LeaseError {
    /// `reading`, `creating`, `taking`, `renewing` or `releasing`.
    pub action: &'static str,
    /// `namespace/name`.
    pub lease: String,
    /// The kind, as counted: `timeout` or [`rivet_k8s::error_kind`]'s.
    pub kind: &'static str,
    /// What went wrong.
    pub cause: LeaseErrorCause,
}

impl LeaseError {
    /// 409: the Lease changed since it was read (another replica wrote it).
    pub fn is_conflict(&self) -> bool {
        matches!(&self.cause, LeaseErrorCause::Api(e) if rivet_k8s::status_code(e) == Some(409))
    }
}

/// The cause of a [`LeaseError`].
#[derive(Debug, thiserror::Error)]
pub enum LeaseErrorCause {
    /// The API call failed.
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// No answer within the time budget.
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
}

/// Why a term ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LostReason {
    /// No renewal succeeded within the renew deadline.
    RenewDeadline,
    /// Another replica holds the Lease now.
    TakenBy(String),
    /// The process is stopping (the Lease is released next).
    Shutdown,
}

impl LostReason {
    /// The metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::RenewDeadline => "renew_deadline",
            Self::TakenBy(_) => "taken",
            Self::Shutdown => "shutdown",
        }
    }
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RenewDeadline => f.write_str("no renewal succeeded within the renew deadline"),
            Self::TakenBy(holder) => write!(f, "the Lease is held by {holder}"),
            Self::Shutdown => f.write_str("shutting down"),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// The election's metrics (`rivet_operator_*`); each event method writes its
/// log line and its metrics together.
#[derive(Clone, Debug, Default)]
pub struct ElectionMetrics {
    leader: Gauge,
    transitions: Counter,
    lost: Family<ReasonLabels, Counter>,
    renew_errors: Family<KindLabels, Counter>,
    acquire_errors: Family<KindLabels, Counter>,
}

impl ElectionMetrics {
    /// Registers every metric under `registry` (prefix it with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("operator");
        r.register("leader", "1 while this replica leads, else 0", self.leader.clone());
        r.register(
            "leader_transitions",
            "Terms of leadership this replica began",
            self.transitions.clone(),
        );
        r.register(
            "leadership_lost",
            "Terms that ended, by reason (renew_deadline, taken, shutdown)",
            self.lost.clone(),
        );
        r.register(
            "lease_renew_errors",
            "Failed renewals of the Lease while leading, by kind (timeout, conflict, forbidden, not_found, invalid, unavailable, other)",
            self.renew_errors.clone(),
        );
        r.register(
            "lease_acquire_errors",
            "Failed reads, creations and takeovers of the Lease while not leading, by kind",
            self.acquire_errors.clone(),
        );
    }

    /// Event: this replica began a term.
    fn became_leader(&self, config: &ElectionConfig, transition: i32, previous: Option<&str>) {
        self.leader.set(1);
        self.transitions.inc();
        tracing::info!(
            identity = config.identity,
            lease = %lease_path(config),
            transition,
            previous_holder = previous.unwrap_or(""),
            "became leader"
        );
    }

    /// Event: this replica's term ended.
    fn lost_leadership(&self, config: &ElectionConfig, reason: &LostReason) {
        self.leader.set(0);
        self.lost
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc();
        tracing::warn!(
            identity = config.identity,
            lease = %lease_path(config),
            reason = reason.as_str(),
            "lost leadership: {reason}"
        );
    }

    /// Event: a renewal failed (logged by the controller with the error).
    fn renew_failed(&self, kind: &'static str) {
        self.renew_errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// Event: an acquisition attempt failed (logged by the controller).
    fn acquire_failed(&self, kind: &'static str) {
        self.acquire_errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// Event: the Lease was released on shutdown.
    fn released(&self, config: &ElectionConfig) {
        tracing::info!(identity = config.identity, lease = %lease_path(config), "released the Lease");
    }
}

fn lease_path(config: &ElectionConfig) -> String {
    format!("{}/{}", config.namespace, config.lease_name)
}

/// A term this replica holds, as [`Elector::leadership`] publishes it.
#[derive(Debug, Clone)]
pub struct Leadership {
    /// The term (ended when leadership is lost).
    pub term: Term,
    /// The instant before the request that won the Lease was sent: the
    /// earliest moment the term may have begun.
    pub began: Instant,
}

/// The Lease as this replica last read or wrote it, and when it saw its
/// record change.
struct Observed {
    lease: Lease,
    changed_at: Instant,
}

struct Leading {
    term: Term,
    duties: Controllers,
    /// When the last successful renewal (or the acquisition) was sent.
    last_sent: Instant,
}

#[derive(Default)]
struct State {
    observed: Option<Observed>,
    leading: Option<Leading>,
}

struct Inner {
    leases: Api<Lease>,
    config: ElectionConfig,
    metrics: ElectionMetrics,
    duties: Vec<Arc<dyn Duty>>,
    /// The daemon's controllers: each term's duties run on a child.
    daemon: Controllers,
    state: Mutex<State>,
    leadership: watch::Sender<Option<Leadership>>,
}

/// The elector of one replica; see the module docs.
pub struct Elector {
    inner: Arc<Inner>,
    /// The election's own controller (stopped first on shutdown).
    election: Controllers,
}

impl std::fmt::Debug for Elector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Elector")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Elector {
    /// Starts competing for the Lease (controller [`CONTROLLER`] on a child
    /// of `controllers`); each term won starts `duties` on its own child of
    /// `controllers`.
    pub fn start(
        client: Client,
        config: ElectionConfig,
        duties: Vec<Arc<dyn Duty>>,
        metrics: ElectionMetrics,
        controllers: &Controllers,
    ) -> Self {
        metrics.leader.set(0);
        let inner = Arc::new(Inner {
            leases: Api::namespaced(client, &config.namespace),
            config,
            metrics,
            duties,
            daemon: controllers.clone(),
            state: Mutex::default(),
            leadership: watch::channel(None).0,
        });
        let election = controllers.child();
        let retry = inner.config.retry_period;
        let pass = inner.clone();
        election.reconcile(
            Controller::new(CONTROLLER).backoff(Backoff::new(retry, retry).with_jitter(0.0)),
            move || {
                let inner = pass.clone();
                async move { inner.step().await.map(|()| Action::requeue(inner.config.retry_period)) }
            },
        );
        Self { inner, election }
    }

    /// This replica's identity.
    pub fn identity(&self) -> &str {
        &self.inner.config.identity
    }

    /// The current term: `Some` from when a term begins (its duties
    /// started), `None` once it has ended and its duties have stopped.
    pub fn leadership(&self) -> watch::Receiver<Option<Leadership>> {
        self.inner.leadership.subscribe()
    }

    /// A clean stop: stops competing, ends the term (if any), waits until its
    /// duties' controllers have stopped, then releases the Lease so another
    /// replica takes over at its next retry.
    pub async fn shutdown(self) -> Result<(), LeaseError> {
        self.election.shutdown().await;
        let was_leading = self.inner.lose(LostReason::Shutdown).await;
        // Not leading, the Lease may still name this replica: a takeover
        // cancelled in flight may have landed. One read tells.
        self.inner.release(!was_leading).await
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lease_path(&self) -> String {
        lease_path(&self.config)
    }

    fn error(&self, action: &'static str, cause: LeaseErrorCause) -> LeaseError {
        let kind = match &cause {
            LeaseErrorCause::Api(e) => rivet_k8s::error_kind(e),
            LeaseErrorCause::TimedOut(_) => "timeout",
        };
        LeaseError {
            action,
            lease: self.lease_path(),
            kind,
            cause,
        }
    }

    /// Runs `call` within `budget`.
    async fn call<T>(
        &self,
        action: &'static str,
        budget: Duration,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, LeaseError> {
        match tokio::time::timeout(budget, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(self.error(action, e.into())),
            Err(_) => Err(self.error(action, LeaseErrorCause::TimedOut(budget))),
        }
    }

    /// Records a read or written Lease; a record different from the last
    /// one observed restarts the expiry clock (client-go's observedTime).
    fn observe(&self, lease: Lease) {
        let mut state = self.lock();
        let changed = state.observed.as_ref().is_none_or(|o| o.lease.spec != lease.spec);
        let changed_at = match &state.observed {
            Some(o) if !changed => o.changed_at,
            _ => Instant::now(),
        };
        state.observed = Some(Observed { lease, changed_at });
    }

    /// One step of the algorithm: renew while leading, else try to acquire.
    async fn step(&self) -> Result<(), LeaseError> {
        let leading = self.lock().leading.as_ref().map(|l| l.last_sent);
        match leading {
            Some(last_sent) => self.renew(last_sent).await,
            None => self.try_acquire().await,
        }
    }

    async fn renew(&self, last_sent: Instant) -> Result<(), LeaseError> {
        let deadline = last_sent + self.config.renew_deadline;
        let sent = Instant::now();
        if sent >= deadline {
            self.lose(LostReason::RenewDeadline).await;
            return Ok(());
        }
        let Some(mut lease) = self.lock().observed.as_ref().map(|o| o.lease.clone()) else {
            // Leading implies a Lease was observed; start over if not.
            self.lose(LostReason::RenewDeadline).await;
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        spec.holder_identity = Some(self.config.identity.clone());
        spec.lease_duration_seconds = Some(self.config.lease_seconds());
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        let written = self
            .call(
                "renewing",
                deadline - sent,
                self.leases
                    .replace(&self.config.lease_name, &PostParams::default(), &lease),
            )
            .await;
        match written {
            Ok(lease) => {
                self.observe(lease);
                let mut state = self.lock();
                if let Some(leading) = state.leading.as_mut() {
                    leading.last_sent = sent;
                    leading.term.renewed(sent + self.config.renew_deadline);
                }
                Ok(())
            }
            Err(e) => {
                self.metrics.renew_failed(e.kind);
                if e.is_conflict() {
                    // Someone else wrote it: whose is it now?
                    let now = Instant::now();
                    if now < deadline
                        && let Ok(Some(current)) = self
                            .call("reading", deadline - now, self.leases.get_opt(&self.config.lease_name))
                            .await
                    {
                        let holder = holder(&current).map(str::to_string);
                        self.observe(current);
                        if let Some(holder) = holder.filter(|h| *h != self.config.identity) {
                            self.lose(LostReason::TakenBy(holder)).await;
                            return Ok(());
                        }
                    }
                }
                if Instant::now() >= deadline {
                    self.lose(LostReason::RenewDeadline).await;
                }
                Err(e)
            }
        }
    }

    async fn try_acquire(&self) -> Result<(), LeaseError> {
        let budget = self.config.renew_deadline;
        let name = &self.config.lease_name;
        let read = self.call("reading", budget, self.leases.get_opt(name)).await;
        let current = read.inspect_err(|e| self.metrics.acquire_failed(e.kind))?;
        let now = Timestamp::now();
        let Some(current) = current else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.record(now, Some(MicroTime(now)), 0)),
            };
            let sent = Instant::now();
            let created = self
                .call("creating", budget, self.leases.create(&PostParams::default(), &lease))
                .await;
            return match created {
                Ok(created) => {
                    self.observe(created);
                    self.begin(0, sent, None);
                    Ok(())
                }
                // Another replica created it first: it leads.
                Err(e) if e.is_conflict() => Ok(()),
                Err(e) => {
                    self.metrics.acquire_failed(e.kind);
                    Err(e)
                }
            };
        };
        self.observe(current.clone());
        let previous = holder(&current).map(str::to_string);
        let old = current.spec.clone().unwrap_or_default();
        let mine = previous.as_deref() == Some(self.config.identity.as_str());
        if let Some(holder) = &previous
            && !mine
        {
            let held_for = old
                .lease_duration_seconds
                .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)))
                .unwrap_or(self.config.lease_duration);
            let changed_at = self.lock().observed.as_ref().map(|o| o.changed_at);
            if changed_at.is_some_and(|at| at.elapsed() < held_for) {
                tracing::debug!(holder, "the Lease is held by another replica");
                return Ok(());
            }
        }
        let transitions = old.lease_transitions.unwrap_or(0);
        let (transitions, acquired) = if mine {
            (transitions, old.acquire_time.clone())
        } else {
            (transitions.saturating_add(1), Some(MicroTime(now)))
        };
        let mut lease = current;
        lease.spec = Some(self.record(now, acquired, transitions));
        let sent = Instant::now();
        let taken = self
            .call(
                "taking",
                budget,
                self.leases.replace(name, &PostParams::default(), &lease),
            )
            .await;
        match taken {
            Ok(taken) => {
                self.observe(taken);
                self.begin(transitions, sent, previous.filter(|_| !mine).as_deref());
                Ok(())
            }
            // Another replica wrote it first (renewed or took it).
            Err(e) if e.is_conflict() => Ok(()),
            Err(e) => {
                self.metrics.acquire_failed(e.kind);
                Err(e)
            }
        }
    }

    /// This replica's record: holding since `acquired`, renewed `now`.
    fn record(&self, now: Timestamp, acquired: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.config.lease_seconds()),
            acquire_time: acquired,
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// Begins a term won by the request sent at `sent` and starts the duties.
    fn begin(&self, transition: i32, sent: Instant, previous: Option<&str>) {
        let term = Term::begin(
            self.config.identity.clone(),
            transition,
            sent + self.config.renew_deadline,
        );
        let duties = self.daemon.child();
        self.metrics.became_leader(&self.config, transition, previous);
        for duty in &self.duties {
            tracing::info!(duty = duty.name(), "starting duty");
            duty.start(&term, &duties);
        }
        self.lock().leading = Some(Leading {
            term: term.clone(),
            duties,
            last_sent: sent,
        });
        self.leadership.send_replace(Some(Leadership { term, began: sent }));
    }

    /// Ends the term (if any) for `reason` and waits until its duties have
    /// stopped; whether there was one.
    async fn lose(&self, reason: LostReason) -> bool {
        let Some(leading) = self.lock().leading.take() else {
            return false;
        };
        leading.term.end();
        self.metrics.lost_leadership(&self.config, &reason);
        leading.duties.shutdown().await;
        // Dropping the set removes its controllers from the board, so the
        // next term may start them under the same names.
        drop(leading.duties);
        self.leadership.send_replace(None);
        true
    }

    /// Writes the Lease without a holder if this replica holds it, starting
    /// from the observed Lease or, with `read_first`, from a fresh read.
    async fn release(&self, read_first: bool) -> Result<(), LeaseError> {
        let budget = self.config.renew_deadline;
        let name = &self.config.lease_name;
        let mut lease = if read_first {
            self.call("reading", budget, self.leases.get_opt(name)).await?
        } else {
            self.lock().observed.as_ref().map(|o| o.lease.clone())
        };
        // Twice at most: a renewal cancelled in flight may have landed,
        // making the observed resourceVersion stale.
        for _ in 0..2 {
            let Some(mut current) = lease.take() else { break };
            if holder(&current) != Some(self.config.identity.as_str()) {
                return Ok(());
            }
            let spec = current.spec.get_or_insert_with(LeaseSpec::default);
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            match self
                .call(
                    "releasing",
                    budget,
                    self.leases.replace(name, &PostParams::default(), &current),
                )
                .await
            {
                Ok(_) => {
                    self.metrics.released(&self.config);
                    return Ok(());
                }
                Err(e) if e.is_conflict() => {
                    lease = self.call("reading", budget, self.leases.get_opt(name)).await?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

fn holder(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()?
        .holder_identity
        .as_deref()
        .filter(|h| !h.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ElectionConfig {
        ElectionConfig {
            namespace: "kube-system".into(),
            lease_name: "rivet-operator".into(),
            identity: "a".into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    #[test]
    fn leader_config_refuses_what_breaks_the_fence() {
        assert_eq!(config().validate(), Ok(()));
        let c = ElectionConfig {
            renew_deadline: Duration::from_secs(16),
            ..config()
        };
        assert!(matches!(
            c.validate(),
            Err(InvalidElection::RenewDeadlineNotBelowLeaseDuration { .. })
        ));
        let c = ElectionConfig {
            retry_period: Duration::from_secs(10),
            ..config()
        };
        assert!(matches!(
            c.validate(),
            Err(InvalidElection::RetryPeriodNotBelowRenewDeadline { .. })
        ));
        let c = ElectionConfig {
            lease_duration: Duration::from_millis(15_500),
            ..config()
        };
        assert!(matches!(
            c.validate(),
            Err(InvalidElection::LeaseDurationNotWholeSeconds(_))
        ));
        let c = ElectionConfig {
            identity: String::new(),
            ..config()
        };
        assert_eq!(c.validate(), Err(InvalidElection::Empty("identity")));
    }
}
