//! Leader election against a real kube-apiserver: failover after kill -9
//! within the lease duration and never earlier; a cut-off leader fenced
//! before another takes over; a clean stop hands over at once; flags that
//! would break the fence refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use rivet_common::controller::{Controller, Controllers};
use rivet_common::testing::{DaemonCommand, metric_sample, workspace_binary};
use rivet_operator::leader::{CONTROLLER, ElectionConfig, ElectionMetrics, Elector, Leadership};
use rivet_operator::term::{Duty, Term};
use rivet_testkit::kube::KubeApiServer;
use rivet_testkit::operator::{LEASE_NAME, LEASE_NAMESPACE, Operator};
use rivet_testkit::relay::TcpRelay;
use tokio::sync::watch;

/// Generous bound on one start or takeover on the shared, busy machine.
const WAIT: Duration = Duration::from_secs(60);
/// Slack for scheduling and API latency on top of what the algorithm allows.
const SLACK: Duration = Duration::from_secs(2);

/// One observed version of the Lease.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    holder: Option<String>,
    renew: Option<Timestamp>,
    acquire: Option<Timestamp>,
    duration_seconds: Option<i32>,
    transitions: Option<i32>,
}

/// Every version of the Lease, as a watch delivers them.
struct LeaseHistory {
    seen: watch::Receiver<Vec<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseHistory {
    fn start(client: kube::Client) -> Self {
        let leases: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
        let (tx, seen) = watch::channel(Vec::new());
        let config = watcher::Config::default().fields(&format!("metadata.name={LEASE_NAME}"));
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(leases, config));
            while let Some(event) = events.next().await {
                let (watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) =
                    event.expect("watching the Lease")
                else {
                    continue;
                };
                let spec = lease.spec.unwrap_or_default();
                let entry = Seen {
                    at: Instant::now(),
                    holder: spec.holder_identity.filter(|h| !h.is_empty()),
                    renew: spec.renew_time.map(|t| t.0),
                    acquire: spec.acquire_time.map(|t| t.0),
                    duration_seconds: spec.lease_duration_seconds,
                    transitions: spec.lease_transitions,
                };
                tx.send_modify(|v| v.push(entry));
            }
        });
        Self { seen, task }
    }

    /// Waits until `done` holds for the history; returns it.
    async fn wait(&mut self, what: &str, done: impl Fn(&[Seen]) -> bool) -> Vec<Seen> {
        let waited = tokio::time::timeout(WAIT, self.seen.wait_for(|v| done(v)))
            .await
            .map(|r| r.map(|history| history.clone()));
        match waited {
            Ok(Ok(history)) => history,
            _ => panic!("waiting for {what}; history: {:#?}", *self.seen.borrow()),
        }
    }
}

impl Drop for LeaseHistory {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn renewals_by(history: &[Seen], holder: &str) -> usize {
    history.iter().filter(|s| s.holder.as_deref() == Some(holder)).count()
}

fn timing_args(lease: u64, renew: u64, retry_ms: u64) -> Vec<String> {
    vec![
        "--leader-election-lease-duration".into(),
        format!("{lease}s"),
        "--leader-election-renew-deadline".into(),
        format!("{renew}s"),
        "--leader-election-retry-period".into(),
        format!("{retry_ms}ms"),
    ]
}

/// A kube-apiserver, the Lease's history, and two operators with these
/// timings: `a` leading, `b` started after it and having seen `a` renew
/// twice since.
struct LeaderAndStandby {
    history: LeaseHistory,
    a: Operator,
    b: Operator,
    _server: KubeApiServer,
}

impl LeaderAndStandby {
    async fn start(lease_seconds: u64, renew_seconds: u64, retry_ms: u64) -> Self {
        let server = KubeApiServer::start().await.expect("kube-apiserver");
        let access = server
            .service_account_client("rivet-operator")
            .await
            .expect("ServiceAccount");
        let args = timing_args(lease_seconds, renew_seconds, retry_ms);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // The duties run for real, on their CRDs.
        server.apply_crds().await.expect("CRDs");
        let mut history = LeaseHistory::start(server.admin_client());
        let a = Operator::start(&access, &args).await.expect("operator a");
        a.wait_leading(WAIT).await.expect("a leads alone");
        let b = Operator::start(&access, &args).await.expect("operator b");
        let seen = renewals_by(&history.seen.borrow(), a.identity());
        history
            .wait("two renewals by a after b started", |h| {
                renewals_by(h, a.identity()) >= seen + 2
            })
            .await;
        assert_eq!(a.leader_gauge().await.unwrap(), 1.0, "a leads");
        assert_eq!(b.leader_gauge().await.unwrap(), 0.0, "b stands by while a renews");
        Self {
            history,
            a,
            b,
            _server: server,
        }
    }

    /// Waits until b holds the Lease; the history up to then.
    async fn wait_b_leads(&mut self) -> Vec<Seen> {
        let b = self.b.identity().to_string();
        self.history
            .wait("b to take the Lease", |h| {
                h.last().is_some_and(|s| s.holder.as_deref() == Some(b.as_str()))
            })
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill9_fails_over_within_the_lease_duration_and_not_before() {
    let (lease, retry) = (Duration::from_secs(6), Duration::from_secs(1));
    let mut pair = LeaderAndStandby::start(6, 4, 1000).await;
    let killed = Instant::now();
    pair.a.kill9();
    let seen = pair.wait_b_leads().await;
    let (a, b) = (&pair.a, &pair.b);
    let taken = seen.last().unwrap();
    let took = taken.at.duration_since(killed);
    // a renewed at most one retry before the kill; b saw that record at most
    // one retry later and takes it at its first retry after a lease duration.
    assert!(
        took <= lease + 2 * retry + SLACK,
        "b took over {took:?} after the kill; allowed: lease duration {lease:?} + 2 retry periods + {SLACK:?}"
    );
    let last_by_a = seen
        .iter()
        .rev()
        .find(|s| s.holder.as_deref() == Some(a.identity()))
        .expect("a's last record");
    let a_renewed = last_by_a.renew.expect("a's renewTime");
    let b_acquired = taken.acquire.expect("b's acquireTime");
    let gap = b_acquired.duration_since(a_renewed);
    assert!(
        gap >= SignedDuration::try_from(lease).unwrap(),
        "b acquired {gap} after a's last renewal: before the lease duration {lease:?} had passed"
    );
    assert_eq!(
        taken.transitions,
        last_by_a.transitions.map(|t| t + 1),
        "a takeover counts a transition"
    );
    assert_eq!(b.leader_gauge().await.unwrap(), 1.0, "b's gauge says it leads");
    assert!(b.log().contains("became leader"), "b logs the event: {}", b.log());

    // a comes back (a new process, a new identity) and stands by.
    pair.a.restart().await.expect("a restarts");
    let b_id = pair.b.identity().to_string();
    let renewals = renewals_by(&pair.history.seen.borrow(), &b_id);
    pair.history
        .wait("two renewals by b after a came back", |h| {
            renewals_by(h, &b_id) >= renewals + 2
        })
        .await;
    assert_eq!(pair.a.leader_gauge().await.unwrap(), 0.0, "the restarted a stands by");
    assert_eq!(pair.b.leader_gauge().await.unwrap(), 1.0, "b still leads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_clean_stop_releases_the_lease_for_an_immediate_takeover() {
    // A long lease: a takeover after it would be obvious.
    let (lease, retry) = (Duration::from_secs(15), Duration::from_secs(1));
    let mut pair = LeaderAndStandby::start(15, 10, 1000).await;
    let stopped = Instant::now();
    let status = pair.a.stop().await.expect("a stops on SIGTERM");
    assert!(
        status.success(),
        "a clean stop exits 0: {status}; log:\n{}",
        pair.a.log()
    );
    let seen = pair.wait_b_leads().await;
    let took = seen.last().unwrap().at.duration_since(stopped);
    assert!(
        took <= 2 * retry + SLACK && took < lease,
        "b took over {took:?} after SIGTERM to a: the release must hand over within about a retry period ({retry:?}), not the lease duration ({lease:?})"
    );
    let release = seen
        .iter()
        .rev()
        .find(|s| s.holder.is_none())
        .expect("a released record (no holder) before b's");
    assert_eq!(
        release.duration_seconds,
        Some(1),
        "released like client-go's ReleaseOnCancel"
    );
    let log = pair.a.log();
    assert!(log.contains("released the Lease"), "a logs the release: {log}");
}

/// A duty that records when its controller stops.
struct StopRecorder {
    stopped: Arc<Mutex<Option<Instant>>>,
}

struct SetOnDrop(Arc<Mutex<Option<Instant>>>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.lock().unwrap().get_or_insert_with(Instant::now);
    }
}

impl Duty for StopRecorder {
    fn name(&self) -> &'static str {
        "stop-recorder"
    }

    fn start(&self, _term: &Term, controllers: &Controllers) {
        let stopped = self.stopped.clone();
        controllers.supervise(Controller::new("stop-recorder"), move |_| {
            let guard = SetOnDrop(stopped.clone());
            async move {
                let _guard = guard;
                std::future::pending::<Result<(), String>>().await
            }
        });
    }
}

fn election(identity: &str) -> ElectionConfig {
    ElectionConfig {
        namespace: LEASE_NAMESPACE.into(),
        lease_name: LEASE_NAME.into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(4),
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(250),
    }
}

/// Elector `a` with a [`StopRecorder`] duty; when that duty stopped.
fn elector_with_recorder(
    client: kube::Client,
    metrics: ElectionMetrics,
    controllers: &Controllers,
) -> (Elector, Arc<Mutex<Option<Instant>>>) {
    let stopped = Arc::new(Mutex::new(None));
    let duty = StopRecorder {
        stopped: stopped.clone(),
    };
    let elector = Elector::start(client, election("a"), vec![Arc::new(duty)], metrics, controllers);
    (elector, stopped)
}

/// Waits until `who` leads; its term.
async fn next_term(leadership: &mut watch::Receiver<Option<Leadership>>, who: &str) -> Leadership {
    let leads = tokio::time::timeout(WAIT, leadership.wait_for(Option::is_some)).await;
    let leads = leads.unwrap_or_else(|_| panic!("{who} did not lead within {WAIT:?}"));
    leads.expect("the elector is alive").clone().expect("a term")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_off_stops_writing_before_another_takes_over() {
    let server = KubeApiServer::start().await.expect("kube-apiserver");
    let access = server
        .service_account_client("rivet-operator")
        .await
        .expect("ServiceAccount");
    let port: u16 = server.url().rsplit(':').next().unwrap().parse().unwrap();
    let relay = TcpRelay::start(([127, 0, 0, 1], port).into()).await.unwrap();
    let kubeconfig = Kubeconfig::read_from(&access.kubeconfig).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    config.cluster_url = format!("https://{}", relay.addr()).parse().unwrap();
    let client_a = kube::Client::try_from(config).unwrap();

    let (controllers_a, controllers_b) = (Controllers::new(), Controllers::new());
    let (a, duty_stopped) = elector_with_recorder(client_a, ElectionMetrics::default(), &controllers_a);
    let mut a_leads = a.leadership();
    let term_a = next_term(&mut a_leads, "a").await.term;
    let b = Elector::start(
        access.client.clone(),
        election("b"),
        Vec::new(),
        ElectionMetrics::default(),
        &controllers_b,
    );
    let mut b_leads = b.leadership();

    // Probe a's fence continuously: the last instant ensure() was Ok (taken
    // after it returned) and the first failure (taken after it returned).
    let stop_probe = Arc::new(AtomicBool::new(false));
    let probe = {
        let (term, stop) = (term_a.clone(), stop_probe.clone());
        tokio::spawn(async move {
            let (mut last_ok, mut first_err) = (None, None);
            while !stop.load(Ordering::Relaxed) {
                let ok = term.ensure().is_ok();
                let now = Instant::now();
                if ok {
                    last_ok = Some(now);
                } else {
                    first_err.get_or_insert(now);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (last_ok, first_err)
        })
    };
    // b sees a renewing for a while, then a is cut off from the API server.
    LeaseHistory::start(server.admin_client())
        .wait("a's renewals seen by the test", |h| renewals_by(h, "a") >= 3)
        .await;
    assert!(b_leads.borrow().is_none(), "b stands by while a renews");
    relay.cut();

    let began_b = next_term(&mut b_leads, "b").await.began;
    tokio::time::timeout(WAIT, a_leads.wait_for(Option::is_none))
        .await
        .expect("a's term ends")
        .unwrap();
    stop_probe.store(true, Ordering::Relaxed);
    let (last_ok, first_err) = probe.await.unwrap();
    let (last_ok, first_err) = (
        last_ok.expect("a's term was valid"),
        first_err.expect("a's fence closed"),
    );
    assert!(
        first_err < began_b,
        "a's ensure() failed {:?} after b began",
        first_err.duration_since(began_b)
    );
    assert!(
        last_ok < began_b,
        "a's ensure() was Ok {:?} after b began",
        last_ok.duration_since(began_b)
    );
    assert!(term_a.ensure().is_err(), "a's term stays ended");
    assert!(
        duty_stopped.lock().unwrap().is_some(),
        "a's duty's controllers were stopped when its term ended"
    );

    b.shutdown().await.expect("b releases the Lease");
    drop(a);
    controllers_a.shutdown().await;
    controllers_b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_whose_lease_is_overwritten_ends_its_term_at_the_next_renewal() {
    let server = KubeApiServer::start().await.expect("kube-apiserver");
    let access = server
        .service_account_client("rivet-operator")
        .await
        .expect("ServiceAccount");
    let controllers = Controllers::new();
    let metrics = ElectionMetrics::default();
    let (a, duty_stopped) = elector_with_recorder(access.client.clone(), metrics.clone(), &controllers);
    let mut leads = a.leadership();
    let term = next_term(&mut leads, "a").await.term;

    // Someone else writes the Lease (another replica whose clock ran
    // fast, an administrator): a's next renewal gets 409 and a steps down.
    let leases: Api<Lease> = Api::namespaced(server.admin_client(), LEASE_NAMESPACE);
    let mut lease = leases.get(LEASE_NAME).await.unwrap();
    let spec = lease.spec.as_mut().unwrap();
    spec.holder_identity = Some("intruder".into());
    spec.lease_duration_seconds = Some(3600);
    leases.replace(LEASE_NAME, &Default::default(), &lease).await.unwrap();
    tokio::time::timeout(WAIT, leads.wait_for(Option::is_none))
        .await
        .expect("a steps down")
        .unwrap();
    assert!(term.ensure().is_err(), "the ended term fences writes");
    assert!(duty_stopped.lock().unwrap().is_some(), "its duties were stopped");
    let mut registry = prometheus_client::registry::Registry::with_prefix("rivet");
    metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert_eq!(
        metric_sample(&text, "rivet_operator_leadership_lost_total{reason=\"taken\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(metric_sample(&text, "rivet_operator_leader"), Some(0.0));
    // The intruder's lease holds: a tries a few more times, in vain.
    let passes = controllers
        .status()
        .iter()
        .find(|c| c.name == CONTROLLER)
        .expect("the election controller")
        .outcomes;
    tokio::time::timeout(WAIT, controllers.wait_outcomes(CONTROLLER, passes + 3))
        .await
        .expect("a keeps trying");
    let lease = leases.get(LEASE_NAME).await.unwrap();
    assert_eq!(lease.spec.unwrap().holder_identity.as_deref(), Some("intruder"));
    assert!(a.leadership().borrow().is_none(), "a stands by");
    a.shutdown().await.expect("nothing to release");
    controllers.shutdown().await;
}

#[test]
fn leader_flags_that_break_the_fence_are_refused() {
    let run = |args: &[&str]| {
        let output = DaemonCommand::new(workspace_binary("rivet-operator"), "unused.sock")
            .args(args)
            .run_to_exit(Duration::from_secs(30))
            .expect("rivet-operator exits");
        assert!(!output.status.success(), "{args:?} must be refused");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let stderr = run(&[
        "--leader-election-lease-duration",
        "15s",
        "--leader-election-renew-deadline",
        "15s",
    ]);
    assert!(
        stderr.contains(
            "--leader-election-renew-deadline (15s) must be shorter than --leader-election-lease-duration (15s)"
        ),
        "a clear message: {stderr}"
    );
    let stderr = run(&[
        "--leader-election-renew-deadline",
        "10s",
        "--leader-election-retry-period",
        "10s",
    ]);
    assert!(
        stderr.contains(
            "--leader-election-retry-period (10s) must be shorter than --leader-election-renew-deadline (10s)"
        ),
        "a clear message: {stderr}"
    );
    let stderr = run(&["--leader-election-lease-duration", "1500ms"]);
    assert!(stderr.contains("whole number of seconds"), "a clear message: {stderr}");
}
