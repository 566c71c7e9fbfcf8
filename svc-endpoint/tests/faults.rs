//! The manager in-process against a node's real daemons, with faults
//! injected per call: a new label set while the kvstore is away, deletes
//! that fail and converge by themselves, deletes that must not wait for
//! unrelated work, endpoints that must not regenerate once closed, and
//! endpoints whose host interface went (dropped at restore on svc-loader's
//! listing; while running by a check that asks svc-loader only whether
//! the interfaces exist).

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rivet_common::controller::Controllers;
use rivet_common::labels::Labels;
use rivet_policy::{Policy, PolicyOrigin};
use rivet_testkit::node::{EndpointNode, NodeOptions};
use support::{Faults, Mode, assert_nothing_left, eventually, faulty_dependencies, options, start_manager};
use svc_endpoint::endpoint::EndpointState;
use svc_endpoint::manager::{EndpointManager, EndpointSelector, ManagerError, ManagerOptions, NewEndpoint};
use svc_endpoint::service::validate_create;
use tonic::{Code, Status};

/// A node without svc-endpoint, its pods wired, and an in-process manager
/// over its daemons behind faults.
struct Setup {
    node: EndpointNode,
    state: tempfile::TempDir,
    faults: Arc<Faults>,
    manager: EndpointManager,
    /// The manager's background loops (dropped: stopped).
    controllers: Controllers,
}

impl Setup {
    async fn start(pods: &[&str], concurrency: Option<usize>) -> Self {
        Self::start_with(pods, |o| {
            if let Some(concurrency) = concurrency {
                o.regeneration_concurrency = concurrency;
            }
        })
        .await
    }

    async fn start_with(pods: &[&str], configure: impl FnOnce(&mut ManagerOptions)) -> Self {
        let mut node = EndpointNode::start(NodeOptions {
            without_endpoint_daemon: true,
            ..NodeOptions::default()
        })
        .await
        .expect("the node's daemons start");
        for pod in pods {
            node.add_pod_interface(pod).await;
        }
        let state = tempfile::tempdir().unwrap();
        let faults = Arc::new(Faults::default());
        let mut options = options(state.path());
        configure(&mut options);
        let (manager, controllers) = start_manager(options, faulty_dependencies(&node, &faults));
        Self {
            node,
            state,
            faults,
            manager,
            controllers,
        }
    }

    /// Creates pod `name`'s endpoint synchronously; its id.
    async fn create(&self, name: &str, labels: &[&str]) -> u16 {
        let (view, _) = self
            .manager
            .create(new_endpoint(&self.node, name, labels, true), Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("creating {name}: {e}"));
        view.spec.id
    }

    /// Asserts that nothing of endpoint `id` of the wired pod `pod` is left
    /// (see [`assert_nothing_left`]).
    async fn assert_nothing_left(&self, id: u16, pod: &str, addresses_released: bool, what: &str) {
        let addresses = self.node.pod(pod).addrs();
        assert_nothing_left(
            &self.node,
            self.state.path(),
            id,
            (pod, &addresses),
            addresses_released,
            what,
        )
        .await;
    }

    /// Waits until the manager knows no endpoint.
    /// Relabels pod `name` (endpoint `id`) while svc-loader's ApplyEndpoint
    /// answers `mode` for it; waits until the worker tried `attempts` times
    /// (retrying, the endpoint kept), then lets the calls through and waits
    /// until the endpoint realised the new labels.
    async fn relabel_while_apply_fails(&self, id: u16, name: &str, mode: Mode, attempts: u32) {
        self.faults.apply.set_for(&format!("endpoint/{id}"), mode);
        relabel(&self.manager, name).await;
        tokio::time::timeout(Duration::from_secs(10), self.faults.apply.entered(attempts))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "retried after each failure ({} calls): {:?}",
                    self.faults.apply.calls(),
                    self.manager.get(&EndpointSelector::Id(id))
                )
            });
        let view = self
            .manager
            .get(&EndpointSelector::Id(id))
            .expect("the endpoint is kept");
        assert_ne!(view.status.state, EndpointState::Disconnecting, "{:?}", view.status);
        self.faults.apply.set(Mode::Pass);
        let relabelled = format!("{name}-relabelled");
        eventually(
            Duration::from_secs(10),
            "the regeneration succeeds once svc-loader does",
            async || {
                self.manager.get(&EndpointSelector::Id(id)).is_ok_and(|v| {
                    v.status.state == EndpointState::Ready && v.status.identity_labels.to_string().contains(&relabelled)
                })
            },
        )
        .await;
    }

    async fn until_empty(&self, what: &str) {
        eventually(Duration::from_secs(10), what, async || self.manager.list().is_empty()).await;
    }
}

/// A synchronous create of pod `name` (wired already) with `labels`.
fn new_endpoint(node: &EndpointNode, name: &str, labels: &[&str], sync: bool) -> NewEndpoint {
    NewEndpoint {
        spec: validate_create(&node.create_request(name, labels)).expect("a valid request"),
        sync,
    }
}

fn container(name: &str) -> EndpointSelector {
    EndpointSelector::Container {
        container_id: name.into(),
        interface: "eth0".into(),
    }
}

/// Issue 12 §6: while the kvstore is away svc-identity cannot allocate an
/// identity for a label set it has not seen (UNAVAILABLE, reason
/// KVSTORE_UNREACHABLE). A synchronous
/// create retries within its deadline and succeeds once the store is back.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_label_set_waits_for_the_kvstore_within_the_deadline_and_succeeds_when_it_returns() {
    let t = Setup::start(&["a"], None).await;
    t.faults.allocate.set(Mode::KvstoreUnreachable);
    let create = tokio::spawn({
        let manager = t.manager.clone();
        let new = new_endpoint(&t.node, "a", &["k8s:app=new-set"], true);
        async move { manager.create(new, Duration::from_secs(20)).await }
    });
    // Two refusals, then the store is back.
    t.faults.allocate.entered(2).await;
    t.faults.allocate.set(Mode::Pass);
    let (view, created) = create
        .await
        .unwrap()
        .expect("the create succeeds once svc-identity can allocate again");
    assert!(created);
    assert_eq!(view.status.state, EndpointState::Ready, "the endpoint is ready");
    assert_ne!(view.status.identity, 0, "it has an identity");
    assert!(t.faults.allocate.calls() >= 2, "the allocation was retried");
}

/// The same while the store stays away for the whole deadline: the create
/// fails with UNAVAILABLE and svc-identity's own reason (the kvstore is
/// unreachable), after retrying, and leaves nothing behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_label_set_fails_with_the_kvstore_reason_at_the_deadline_and_leaves_nothing() {
    let t = Setup::start(&["a"], None).await;
    t.faults.allocate.set(Mode::KvstoreUnreachable);
    let deadline = Duration::from_secs(2);
    let started = Instant::now();
    let e = t
        .manager
        .create(new_endpoint(&t.node, "a", &["k8s:app=new-set"], true), deadline)
        .await
        .expect_err("no identity can be allocated");
    let took = started.elapsed();
    let id = match &e {
        ManagerError::IdentityUnavailable { id, undone, .. } => {
            assert!(*undone, "the failed create is undone: {e}");
            *id
        }
        other => panic!("expected the kvstore to be named as the reason, got: {other}"),
    };
    let status = Status::from(e);
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("the store is unreachable") && status.message().contains("kvstore"),
        "the error gives svc-identity's reason: {}",
        status.message()
    );
    assert!(
        t.faults.allocate.calls() >= 2,
        "the allocation was retried within the deadline ({} calls)",
        t.faults.allocate.calls()
    );
    assert!(
        took >= deadline / 2 && took < deadline + Duration::from_secs(2),
        "it retried until about the deadline: {took:?}"
    );
    t.until_empty("the undone endpoint is gone").await;
    t.assert_nothing_left(id, "a", false, "after a create that found no identity")
        .await;
}

/// Issue 12 §6: a delete that fails (here svc-identity cannot unpublish the
/// addresses) returns the error and leaves the endpoint `disconnecting`;
/// svc-endpoint retries by itself until it is gone, and then releases the
/// addresses the CNI kept (a CNI whose delete failed keeps them). Repeated
/// deletes stay idempotent.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_delete_converges_by_itself_and_releases_the_addresses_the_caller_kept() {
    let t = Setup::start(&["a"], None).await;
    let id = t.create("a", &["k8s:app=a"]).await;

    t.faults.delete_ip.set(Mode::Unavailable);
    for attempt in 1..=2 {
        let e = t
            .manager
            .delete(&container("a"), Duration::from_secs(5))
            .await
            .expect_err("the delete fails while svc-identity refuses");
        assert!(
            matches!(&e, ManagerError::Removal { id: failed, step: "ipcache", .. } if *failed == id),
            "delete {attempt}: the error names the endpoint and the step: {e}"
        );
        assert_eq!(Status::from(e).code(), Code::Unavailable);
        let left = t.manager.get(&container("a")).expect("the endpoint is still known");
        assert_eq!(left.status.state, EndpointState::Disconnecting);
    }
    // svc-endpoint retries by itself (and keeps failing meanwhile).
    let tried = t.faults.delete_ip.calls();
    tokio::time::timeout(Duration::from_secs(10), t.faults.delete_ip.entered(tried + 2))
        .await
        .expect("the removal is retried in the background");

    t.faults.delete_ip.set(Mode::Pass);
    t.until_empty("the endpoint is removed without a new call").await;
    t.assert_nothing_left(id, "a", true, "after the delete converged").await;
    assert_eq!(
        t.manager.delete(&container("a"), Duration::from_secs(5)).await.unwrap(),
        Vec::<u16>::new(),
        "a delete after it converged finds nothing and succeeds"
    );
}

/// Issue 12 §4: a delete never waits behind other endpoints'
/// regenerations, and an endpoint that is closed never regenerates
/// afterwards. With one regeneration permit held by a hung regeneration of
/// b, a's worker waits for the permit with a's regeneration requested; the
/// delete of a completes at once and a never reaches the datapath again.
/// (current_thread: yielding lets a's worker run up to its wait.)
#[tokio::test]
async fn a_delete_does_not_wait_behind_other_regenerations_and_a_closed_endpoint_never_regenerates() {
    let t = Setup::start(&["a", "b", "c"], Some(1)).await;
    let a = t.create("a", &["k8s:app=a"]).await;

    // b's first regeneration hangs in svc-identity, holding the only permit.
    t.faults.allocate.set_for("k8s:app=slow", Mode::Block);
    t.manager
        .create(
            new_endpoint(&t.node, "b", &["k8s:app=slow"], false),
            Duration::from_secs(20),
        )
        .await
        .expect("b's asynchronous create is accepted");
    t.faults.allocate.entered(1).await;
    // a's regeneration is requested; its worker waits for the permit.
    relabel(&t.manager, "a").await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    t.faults.apply.set_for(&format!("endpoint/{a}"), Mode::Pass);

    let deleted = tokio::time::timeout(
        Duration::from_secs(5),
        t.manager.delete(&container("a"), Duration::from_secs(20)),
    )
    .await
    .expect("the delete of a does not wait for b's regeneration")
    .expect("the delete succeeds");
    assert_eq!(deleted, vec![a]);

    // b finishes; then c's synchronous create gets the permit after
    // anything a's worker could still have queued for.
    t.faults.allocate.set(Mode::Pass);
    t.create("c", &["k8s:app=c"]).await;
    assert_eq!(
        t.faults.apply.calls(),
        0,
        "a closed endpoint never reaches the datapath again"
    );
    t.assert_nothing_left(a, "a", false, "after a's delete").await;
}

/// A delete whose endpoint's own regeneration hangs on a dependency
/// returns at its deadline (the caller keeps the addresses); the
/// regeneration stops at its next step once the call returns, and the
/// removal completes in the background, releasing the addresses.
#[tokio::test(flavor = "multi_thread")]
async fn a_delete_behind_its_hung_regeneration_returns_at_its_deadline_and_completes_later() {
    let t = Setup::start(&["a"], None).await;
    let id = t.create("a", &["k8s:app=a"]).await;

    t.faults.apply.set_for(&format!("endpoint/{id}"), Mode::Block);
    relabel(&t.manager, "a").await;
    t.faults.apply.entered(1).await;
    let started = Instant::now();
    let e = tokio::time::timeout(
        Duration::from_secs(10),
        t.manager.delete(&container("a"), Duration::from_secs(1)),
    )
    .await
    .expect("the delete returns at its deadline")
    .expect_err("the removal cannot finish while the regeneration hangs");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the delete returned at its deadline: {:?}",
        started.elapsed()
    );
    assert_eq!(Status::from(e).code(), Code::Unavailable);

    t.faults.apply.set(Mode::Pass);
    t.until_empty("the removal completes in the background").await;
    t.assert_nothing_left(id, "a", true, "after the delete converged").await;
}

/// Issue 13 §1: an endpoint's worker that panics (here in the code around
/// a dependency call of its first regeneration) does not die silently: it
/// is started again for its endpoint, which regenerates (the synchronous
/// create that waited for it succeeds), and the panic restarts the
/// `endpoint-workers` controller, which counts it and keeps its message.
#[tokio::test(flavor = "multi_thread")]
async fn an_endpoint_worker_that_panics_is_started_again_and_counted() {
    let setup = Setup::start(&["a"], None).await;
    setup.faults.apply.set(Mode::PanicOnce);
    let id = setup.create("a", &["k8s:app=a"]).await;
    assert_eq!(
        setup.faults.apply.calls(),
        2,
        "the panicked apply and the one of the restarted worker"
    );
    let view = setup
        .manager
        .get(&EndpointSelector::Id(id))
        .expect("the endpoint exists");
    assert_eq!(view.status.state, EndpointState::Ready, "{:?}", view.status);
    // Its first progress, then the restart.
    setup.controllers.wait_outcomes("endpoint-workers", 2).await;
    let workers = setup
        .controllers
        .status()
        .into_iter()
        .find(|c| c.name == "endpoint-workers")
        .expect("endpoint-workers is a controller");
    assert_eq!(workers.restarts, 1, "the panic was counted: {workers:?}");
    assert!(
        workers
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("applying an endpoint: injected panic")),
        "the panic's message is kept: {workers:?}"
    );
}

/// A background regeneration that keeps failing is retried with backoff
/// until it succeeds (before, the worker gave up after the second failure:
/// the first retry's own wake-up cut the next backoff short and it waited
/// for a new request that never came).
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_background_regeneration_is_retried_until_it_succeeds() {
    let setup = Setup::start(&["a"], None).await;
    let id = setup.create("a", &["k8s:app=a"]).await;
    setup.relabel_while_apply_fails(id, "a", Mode::Internal, 4).await;
}

/// A restarted dependency is owed the replay of its desired state until
/// one succeeded: a restarted svc-ipam that refuses to take an endpoint's
/// addresses back is asked again at every probe (before, the replay ran
/// once per new boot id and a failure left the addresses unreserved).
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_replay_into_a_restarted_dependency_is_retried_until_it_succeeds() {
    let mut setup = Setup::start(&["a"], None).await;
    setup.create("a", &["k8s:app=a"]).await;
    setup.faults.ipam_restore.set(Mode::Internal);
    setup.node.ipam.kill9();
    setup.node.ipam.restart().await.expect("svc-ipam restarts");
    tokio::time::timeout(Duration::from_secs(10), setup.faults.ipam_restore.entered(3))
        .await
        .unwrap_or_else(|_| panic!("the replay is retried: {:?}", setup.manager.dependencies()));
    setup.faults.ipam_restore.set(Mode::Pass);
    let owed = |setup: &Setup| {
        setup
            .manager
            .dependencies()
            .into_iter()
            .find(|d| d.name == "svc-ipam")
            .expect("svc-ipam is a dependency")
    };
    eventually(
        Duration::from_secs(10),
        "the replay succeeds once svc-ipam takes it",
        async || {
            let ipam = owed(&setup);
            !ipam.resync_owed && ipam.last_error.is_empty()
        },
    )
    .await;
}

/// Issue 13 §2: svc-endpoint drops an endpoint (and releases its
/// addresses) because its host interface is gone only when svc-loader says
/// so with its reason (INTERFACE_NOT_FOUND); a bare NOT_FOUND says nothing
/// about the interface and is retried like any failure (before, any
/// NOT_FOUND of ApplyEndpoint dropped the endpoint).
#[tokio::test(flavor = "multi_thread")]
async fn a_not_found_without_the_loaders_reason_never_drops_an_endpoint() {
    let setup = Setup::start(&["a"], None).await;
    let id = setup.create("a", &["k8s:app=a"]).await;
    setup
        .relabel_while_apply_fails(id, "a", Mode::NotFoundWithoutReason, 2)
        .await;
}

/// A regeneration that fails because a dependency answered ABORTED
/// (svc-identity: allocation contention) is a failure its waiter hears
/// of; only svc-endpoint's own "endpoint removed" ends a wait quietly
/// (before, any ABORTED did: a relabel that waited returned success with
/// nothing realised).
#[tokio::test(flavor = "multi_thread")]
async fn an_aborted_answer_of_a_dependency_is_a_failure_not_a_removal() {
    let setup = Setup::start(&["a"], None).await;
    let id = setup.create("a", &["k8s:app=a"]).await;
    setup.faults.allocate.set(Mode::Aborted);
    let e = setup
        .manager
        .update_labels(
            &container("a"),
            Labels::parse(&["k8s:app=a-relabelled".to_string()]).unwrap(),
            true,
            Duration::from_secs(20),
        )
        .await
        .expect_err("the relabel's regeneration failed");
    assert!(
        matches!(&e, ManagerError::Regeneration { id: failed, source, .. } if *failed == id && source.status.code() == Code::Aborted),
        "{e}"
    );
}

/// Changes pod `name`'s labels without waiting: its worker regenerates.
async fn relabel(manager: &EndpointManager, name: &str) {
    manager
        .update_labels(
            &container(name),
            Labels::parse(&[format!("k8s:app={name}-relabelled")]).unwrap(),
            false,
            Duration::from_secs(20),
        )
        .await
        .unwrap_or_else(|e| panic!("relabelling {name}: {e}"));
}

/// Issue 12 §4: CIDR identity reconciliation runs one pass at a time and
/// the latest desired state wins. The policy's own pass fails, the
/// background retry hangs in svc-identity with the policy's prefix; the
/// policy is deleted meanwhile; when svc-identity answers, the stale pass
/// must not insert the prefix (before, it did, after the delete's own pass
/// had found nothing to release: the CIDR identity stayed allocated).
#[tokio::test(flavor = "multi_thread")]
async fn a_stale_cidr_pass_never_reinserts_a_prefix_after_its_policy_was_deleted() {
    let t = Setup::start(&[], None).await;
    t.faults.allocate_cidrs.set(Mode::Unavailable);
    let policy = Policy::parse(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: out}\nspec:\n  podSelector: {}\n  policyTypes: [Egress]\n  egress:\n  - to:\n    - ipBlock: {cidr: 198.19.64.0/24}\n",
    )
    .unwrap();
    let key = policy.key().clone();
    let deadline = Duration::from_secs(20);
    t.manager
        .upsert_policy(policy, PolicyOrigin::Directory, false, deadline)
        .await
        .expect("the policy is stored although its CIDR identity is not allocated yet");
    t.faults.allocate_cidrs.set(Mode::Block);
    t.faults.allocate_cidrs.blocked(1).await;

    // (svc-identity lists a CIDR identity while it holds a reference.)
    let delete = tokio::spawn({
        let manager = t.manager.clone();
        async move {
            manager
                .delete_policy(&key, PolicyOrigin::Directory, false, deadline)
                .await
        }
    });
    eventually(
        Duration::from_secs(10),
        "the repository forgot the policy",
        async || t.manager.policy_summary().1 == 0,
    )
    .await;
    t.faults.allocate_cidrs.set(Mode::Pass);
    delete
        .await
        .unwrap()
        .expect("the delete succeeds")
        .expect("the policy existed");

    eventually(
        Duration::from_secs(5),
        "no CIDR identity is held for the deleted policy",
        async || {
            let listed = t.node.local_identities().await;
            !listed
                .identities
                .iter()
                .any(|i| i.labels.iter().any(|l| l == "cidr:198.19.64.0/24") && i.local_references > 0)
        },
    )
    .await;
}

/// A policy change answers by its deadline whatever svc-identity does (the
/// chaos run saw an apply right after an etcd restart outlive its own
/// deadline): with AllocateCidrIdentities hanging, an apply that needs a
/// CIDR identity ends in DEADLINE at its deadline, the policy stored, and
/// an apply that needs none meanwhile is realised at once instead of
/// queueing behind it. Before, both waited on the hung pass.
#[tokio::test(flavor = "multi_thread")]
async fn a_policy_change_answers_by_its_deadline_while_svc_identity_hangs() {
    let t = Setup::start(&["a"], None).await;
    let a = t.create("a", &["k8s:app=a"]).await;
    t.faults.allocate_cidrs.set(Mode::Block);
    let egress = Policy::parse(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: out}\nspec:\n  podSelector: {}\n  policyTypes: [Egress]\n  egress:\n  - to:\n    - ipBlock: {cidr: 198.19.64.0/24}\n",
    )
    .unwrap();
    let deadline = Duration::from_secs(3);
    let apply = tokio::spawn({
        let manager = t.manager.clone();
        async move {
            let started = Instant::now();
            let result = manager.upsert_policy(egress, PolicyOrigin::Api, true, deadline).await;
            (result, started.elapsed())
        }
    });
    t.faults.allocate_cidrs.blocked(1).await;

    let ingress = Policy::parse(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: in}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from:\n    - podSelector: {matchLabels: {app: b}}\n",
    )
    .unwrap();
    let update = tokio::time::timeout(
        Duration::from_secs(10),
        t.manager
            .upsert_policy(ingress, PolicyOrigin::Api, true, Duration::from_secs(20)),
    )
    .await
    .expect("a policy without CIDR peers must not queue behind one waiting on svc-identity")
    .expect("a policy without CIDR peers is realised while another waits on svc-identity");
    assert_eq!(update.endpoints, [a], "the ingress policy selects a");
    assert_eq!(update.realised, 1, "a realised the ingress policy");

    let (result, took) = apply.await.unwrap();
    let e = result.expect_err("the egress policy cannot be realised without its CIDR identity");
    assert!(matches!(e, ManagerError::Deadline { undone: false, .. }), "{e}");
    assert!(
        took < deadline + Duration::from_millis(500),
        "a policy change must answer by its deadline ({deadline:?}), not after {took:?}"
    );
    assert_eq!(t.manager.policy_summary().1, 2, "both policies are stored");

    t.faults.allocate_cidrs.set(Mode::Pass);
    eventually(
        Duration::from_secs(10),
        "the CIDR identity is allocated once svc-identity answers",
        async || {
            let listed = t.node.local_identities().await;
            listed
                .identities
                .iter()
                .any(|i| i.labels.iter().any(|l| l == "cidr:198.19.64.0/24") && i.local_references > 0)
        },
    )
    .await;
}

/// Issue 12 §4: an identity event resolves only the endpoints whose
/// policies' selectors it changes (before, every endpoint's policy was
/// resolved under the manager's lock on each event). A new web pod's
/// identity concerns db's policy only: db is resolved again, the four
/// unrelated endpoints are not. A policy with peers is resolved on a
/// blocking thread here (threshold 0), as large ones are, with the same
/// result.
#[tokio::test(flavor = "multi_thread")]
async fn an_identity_event_resolves_only_the_endpoints_whose_selectors_it_changes() {
    let pods = ["db", "web", "o1", "o2", "o3", "o4"];
    let t = Setup::start_with(&pods, |o| o.blocking_resolution_above = 0).await;
    t.manager
        .upsert_policy(
            Policy::parse(
                "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress:\n  - from:\n    - podSelector: {matchLabels: {app: web}}\n",
            )
            .unwrap(),
            PolicyOrigin::Api,
            true,
            Duration::from_secs(20),
        )
        .await
        .expect("the policy is stored");
    let db = t.create("db", &["k8s:app=db"]).await;
    for other in ["o1", "o2", "o3", "o4"] {
        t.create(other, &[&format!("k8s:app={other}")]).await;
    }
    let before = t.manager.metrics().policy_resolutions();

    let web = t.create("web", &["k8s:app=web"]).await;
    let web_identity = t.manager.get(&EndpointSelector::Id(web)).unwrap().status.identity;
    eventually(
        Duration::from_secs(10),
        "db's policy allows the new web identity",
        async || {
            let db = t.manager.get(&EndpointSelector::Id(db)).unwrap();
            db.status
                .realised_policy
                .is_some_and(|p| p.entries.iter().any(|e| e.peer_identity == web_identity))
        },
    )
    .await;
    let after = t.manager.metrics().policy_resolutions();
    let (inline, blocking) = (after.0 - before.0, after.1 - before.1);
    assert_eq!(
        inline + blocking,
        2,
        "web's own resolution and db's: the unrelated endpoints are not resolved ({before:?} -> {after:?})"
    );
    assert_eq!(
        blocking, 1,
        "db's policy, which has peers, is resolved on a blocking thread"
    );
}

/// svc-endpoint stopped, a pod's network namespace (and with it its host
/// veth) deleted, svc-endpoint started: restore drops the endpoint on
/// svc-loader's listing, without trying to realise it first, and releases
/// its addresses, identity reference, ipcache entries and state dir.
#[tokio::test(flavor = "multi_thread")]
async fn restore_drops_an_endpoint_whose_interface_went_while_svc_endpoint_was_down_on_the_loaders_listing() {
    let mut node = EndpointNode::start(NodeOptions::default())
        .await
        .expect("the node's daemons start");
    let stays = node.add_pod("stays", &["k8s:app=stays"]).await;
    let gone = node.add_pod("gone", &["k8s:app=gone"]).await;
    let addresses = node.pod("gone").addrs();
    node.endpoint_daemon().kill9();
    assert!(node.node.node.remove_pod("gone"), "the pod existed");
    let node_ns = &node.node.node.ns;
    eventually(Duration::from_secs(10), "the pod's host veth is deleted", async || {
        !node_ns.has_link(&gone.host_interface).unwrap()
    })
    .await;

    // svc-endpoint again (in-process, over the same state dir and daemons),
    // counting the ApplyEndpoint calls for the vanished pod's endpoint.
    let faults = Arc::new(Faults::default());
    faults.apply.set_for(&format!("endpoint/{}", gone.id), Mode::Pass);
    let (manager, _controllers) = start_manager(options(&node.state_dir()), faulty_dependencies(&node, &faults));
    tokio::time::timeout(Duration::from_secs(30), manager.restored())
        .await
        .expect("restore completes");
    let progress = manager.restore_progress();
    assert_eq!(
        (progress.found, progress.restored, progress.dropped, progress.failed),
        (2, 1, 1, 0),
        "one endpoint restored, the one without an interface dropped: {progress:?}"
    );
    assert_eq!(
        faults.apply.calls(),
        0,
        "restore drops the endpoint on svc-loader's listing, without an ApplyEndpoint for it"
    );
    let left: Vec<u32> = manager.list().iter().map(|v| u32::from(v.spec.id)).collect();
    assert_eq!(left, [stays.id], "only the other pod's endpoint is left");
    assert_nothing_left(
        &node,
        &node.state_dir(),
        u16::try_from(gone.id).unwrap(),
        ("gone", &addresses),
        true,
        "after restore",
    )
    .await;
}

/// The periodic interface check with `interfaces` as svc-loader's
/// ListEndpointInterfaces answer: pod "gone" loses its network namespace
/// while running and its endpoint is dropped and releases everything.
/// Returns the ListEndpoints and ListEndpointInterfaces calls made from
/// the loss to the drop.
async fn interface_check_drops_a_vanished_pod(interfaces: Mode) -> (u32, u32) {
    let mut t = Setup::start_with(&["stays", "gone"], |o| o.interface_check = Duration::from_millis(50)).await;
    t.faults.interfaces.set(interfaces);
    tokio::time::timeout(Duration::from_secs(30), t.manager.restored())
        .await
        .expect("restore completes");
    t.create("stays", &["k8s:app=stays"]).await;
    let id = t.create("gone", &["k8s:app=gone"]).await;
    let addresses = t.node.pod("gone").addrs();
    let before = (t.faults.list.calls(), t.faults.interfaces.calls());
    assert!(t.node.node.node.remove_pod("gone"), "the pod existed");
    eventually(
        Duration::from_secs(10),
        "the endpoint of the vanished pod is dropped",
        async || t.manager.list().iter().all(|v| v.spec.id != id),
    )
    .await;
    assert_eq!(t.manager.list().len(), 1, "the other endpoint stays");
    assert_nothing_left(
        &t.node,
        t.state.path(),
        id,
        ("gone", &addresses),
        true,
        "after the interface check",
    )
    .await;
    (t.faults.list.calls() - before.0, t.faults.interfaces.calls() - before.1)
}

/// The periodic interface check costs svc-loader one link dump
/// (ListEndpointInterfaces), never its full listing (two tc queries per
/// interface), and drops an endpoint whose interface went.
#[tokio::test(flavor = "multi_thread")]
async fn the_interface_check_asks_only_whether_interfaces_exist() {
    let (listings, checks) = interface_check_drops_a_vanished_pod(Mode::Pass).await;
    assert_eq!(listings, 0, "no ListEndpoints from the periodic check");
    assert!(checks > 0, "the check asked ListEndpointInterfaces");
}

/// With an svc-loader older than svc-endpoint (no ListEndpointInterfaces)
/// the check falls back to its full listing and still drops the endpoint.
#[tokio::test(flavor = "multi_thread")]
async fn the_interface_check_falls_back_to_the_full_listing_of_an_older_svc_loader() {
    let (listings, _) = interface_check_drops_a_vanished_pod(Mode::Unimplemented).await;
    assert!(listings > 0, "the check used ListEndpoints");
}
