//! Identity GC over svc-identity's etcd store, in-process against a real
//! etcd 3.6, with svc-identity's own `EtcdBackend` as the nodes.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use futures::StreamExt;
use rivet_common::controller::Controllers;
use rivet_common::identity::CIDR_IDENTITY_MIN;
use rivet_common::testing::etcd::EtcdServer;
use rivet_operator::identity_gc::etcd::EtcdIdentityGc;
use rivet_operator::identity_gc::rounds::SkipReason;
use rivet_operator::identity_gc::{DeleteRate, GcError, IdentityGcMetrics, Store};
use rivet_operator::kvstore::Layout;
use rivet_operator::term::Term;
use svc_identity::backend::{AcquireOutcome, CreateOutcome, IdentityBackend};
use svc_identity::etcd_backend::{EtcdBackend, EtcdOptions};

fn term() -> Term {
    Term::begin("test", 0, Instant::now() + Duration::from_secs(3600))
}

async fn node(etcd: &EtcdServer, name: &str) -> EtcdBackend {
    let options = EtcdOptions {
        lease_ttl: Duration::from_secs(30),
        ..EtcdOptions::new(vec![etcd.endpoint()], name)
    };
    EtcdBackend::connect(options, &Controllers::new())
        .await
        .expect("svc-identity's backend connects")
}

async fn raw(etcd: &EtcdServer) -> Client {
    Client::connect([etcd.endpoint()], None).await.expect("raw client")
}

fn new_gc(client: Client, per_second: u32) -> (EtcdIdentityGc, IdentityGcMetrics) {
    let metrics = IdentityGcMetrics::default();
    let rate = DeleteRate::per_second(NonZeroU32::new(per_second).unwrap());
    (
        EtcdIdentityGc::new(client, Layout::default(), rate, metrics.clone()).with_page_size(7),
        metrics,
    )
}

async fn master(client: &mut Client, id: u32) -> Option<String> {
    let resp = client.get(Layout::default().id_key(id), None).await.unwrap();
    resp.kvs().first().map(|kv| kv.value_str().unwrap().to_string())
}

/// A released identity: its master stays, no value key.
async fn unused(node: &EtcdBackend, id: u32, labels: &str) {
    assert_eq!(node.create_identity(id, labels).await.unwrap(), CreateOutcome::Created);
    node.release(labels).await.unwrap();
}

#[tokio::test]
async fn an_unused_identity_goes_after_exactly_two_rounds_and_a_used_one_never() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let a = node(&etcd, "node-a").await;
    let b = node(&etcd, "node-b").await;
    let mut c = raw(&etcd).await;
    unused(&a, 300, "k8s:app=web").await;
    assert_eq!(
        a.create_identity(301, "k8s:app=db").await.unwrap(),
        CreateOutcome::Created
    );
    // A label set whose value-key prefix holds a longer set's keys (a label
    // with an empty value and a DNS prefix): only exact keys count.
    unused(&a, 302, "k8s:example.com").await;
    assert_eq!(
        b.create_identity(303, "k8s:example.com/x=y").await.unwrap(),
        CreateOutcome::Created
    );
    // A CIDR-range master with no value key (never written by svc-identity,
    // but never collected either).
    c.put(Layout::default().id_key(CIDR_IDENTITY_MIN), "cidr:198.18.0.0/24", None)
        .await
        .unwrap();
    // Enough masters that the paged reads take several pages (7 per page).
    for id in 310..330 {
        assert_eq!(
            a.create_identity(id, &format!("k8s:app=p{id}")).await.unwrap(),
            CreateOutcome::Created
        );
    }
    let (mut gc, metrics) = new_gc(c.clone(), 1000);
    let term = term();

    let first = gc.round(&term).await.unwrap();
    assert_eq!((first.scanned, first.in_use, first.deleted), (24, 22, 0), "{first:?}");
    assert_eq!(first.candidates, 2, "300 and 302 are remembered");
    assert_eq!(
        master(&mut c, 300).await.as_deref(),
        Some("k8s:app=web"),
        "not after one round"
    );

    let second = gc.round(&term).await.unwrap();
    assert_eq!(second.deleted, 2, "{second:?}");
    assert_eq!(master(&mut c, 300).await, None);
    assert_eq!(master(&mut c, 302).await, None);
    for id in [301, 303, 310, 329] {
        assert!(master(&mut c, id).await.is_some(), "{id} is used");
    }
    assert!(
        master(&mut c, CIDR_IDENTITY_MIN).await.is_some(),
        "CIDR identities are never collected"
    );
    assert_eq!(metrics.deleted(Store::Etcd), 2);
    assert_eq!(metrics.runs(Store::Etcd, "succeeded"), 2);

    let third = gc.round(&term).await.unwrap();
    assert_eq!((third.deleted, third.candidates), (0, 0));
}

#[tokio::test]
async fn an_identity_reused_and_released_between_the_rounds_survives_them() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let a = node(&etcd, "node-a").await;
    let b = node(&etcd, "node-b").await;
    let mut c = raw(&etcd).await;
    unused(&a, 300, "k8s:app=web").await;
    let (mut gc, metrics) = new_gc(c.clone(), 1000);
    let term = term();
    assert_eq!(gc.round(&term).await.unwrap().candidates, 1);

    // Node b uses the identity (a pod started) and releases it (the pod
    // went) between the rounds: at round two it is unused again, but it was
    // not unused for two rounds.
    assert_eq!(b.acquire(300, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
    b.release("k8s:app=web").await.unwrap();
    let second = gc.round(&term).await.unwrap();
    assert_eq!(second.deleted, 0, "{second:?}");
    assert_eq!(master(&mut c, 300).await.as_deref(), Some("k8s:app=web"));
    assert_eq!(metrics.skipped(Store::Etcd, SkipReason::Reused), 1);

    // Unused over rounds two and three: gone.
    assert_eq!(gc.round(&term).await.unwrap().deleted, 1);
    assert_eq!(master(&mut c, 300).await, None);
}

/// Round two's deletes run while node b acquires the same identities:
/// each acquire comes before its delete (the master moved: skipped) or
/// after it (the master is re-created): never a value key without its
/// master.
#[tokio::test]
async fn acquires_racing_round_two_never_leave_a_value_key_without_its_master() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let a = node(&etcd, "node-a").await;
    let b = node(&etcd, "node-b").await;
    let mut c = raw(&etcd).await;
    let layout = Layout::default();
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for batch in 0..8u32 {
        let ids: Vec<u32> = (0..40).map(|i| 1000 + batch * 100 + i).collect();
        for &id in &ids {
            unused(&a, id, &format!("k8s:app=r{id}")).await;
        }
        let (mut gc, _) = new_gc(c.clone(), 100_000);
        let term = term();
        assert_eq!(gc.round(&term).await.unwrap().candidates, ids.len());
        let acquires = async {
            let mut got = Vec::new();
            // Odd ids only, from the back: the deletes go from the front.
            for &id in ids.iter().rev().filter(|id| *id % 2 == 1) {
                got.push((id, b.acquire(id, &format!("k8s:app=r{id}")).await.unwrap()));
            }
            got
        };
        let (report, acquired) = tokio::join!(gc.round(&term), acquires);
        let report = report.unwrap();
        for (id, outcome) in acquired {
            let labels = format!("k8s:app=r{id}");
            let value = c.get(layout.value_key(&labels, "node-b"), None).await.unwrap();
            assert_eq!(value.kvs().len(), 1, "{id}: b's value key");
            assert_eq!(
                master(&mut c, id).await.as_deref(),
                Some(labels.as_str()),
                "{id}: a value key needs its master ({outcome:?})"
            );
            *outcomes
                .entry(match outcome {
                    AcquireOutcome::Acquired => "acquired before the delete",
                    AcquireOutcome::MasterRecreated => "re-created after the delete",
                    AcquireOutcome::Conflict => panic!("{id}: conflict"),
                })
                .or_default() += 1;
        }
        // Even ids nobody acquired are gone.
        for id in ids.iter().filter(|id| *id % 2 == 0) {
            assert_eq!(master(&mut c, *id).await, None, "{id} unused for two rounds");
        }
        assert!(report.deleted >= 20, "{report:?}");
    }
    eprintln!("acquire outcomes racing the deletes: {outcomes:?}");
    assert_eq!(outcomes.values().sum::<usize>(), 8 * 20);
}

#[tokio::test]
async fn a_term_that_ended_deletes_nothing() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let a = node(&etcd, "node-a").await;
    let mut c = raw(&etcd).await;
    unused(&a, 300, "k8s:app=web").await;
    let (mut gc, metrics) = new_gc(c.clone(), 1000);
    let term = term();
    gc.round(&term).await.unwrap();
    term.end();
    let err = gc.round(&term).await.expect_err("an ended term writes nothing");
    assert!(matches!(err, GcError::NotLeading(_)), "{err}");
    assert_eq!(master(&mut c, 300).await.as_deref(), Some("k8s:app=web"));
    assert_eq!(metrics.runs(Store::Etcd, "not_leading"), 1);

    // A term past its renew deadline neither.
    let lapsed = Term::begin("test", 1, Instant::now());
    let (mut gc, _) = new_gc(c.clone(), 1000);
    gc.round(&lapsed).await.unwrap();
    assert!(matches!(gc.round(&lapsed).await, Err(GcError::NotLeading(_))));
    assert!(master(&mut c, 300).await.is_some());
}

#[tokio::test]
async fn deletions_honour_the_rate_limit() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let mut c = raw(&etcd).await;
    let layout = Layout::default();
    for id in 300..360 {
        c.put(layout.id_key(id), format!("k8s:app=n{id}"), None).await.unwrap();
    }
    const RATE: u32 = 20;
    let (mut gc, _) = new_gc(c.clone(), RATE);
    let term = term();
    gc.round(&term).await.unwrap();
    let mut events = c
        .watch(layout.id_prefix(), Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap();
    let started = Instant::now();
    let deletions = async {
        let mut times = Vec::new();
        while times.len() < 60 {
            let resp = events.next().await.unwrap().unwrap();
            for event in resp.events() {
                assert_eq!(event.event_type(), EventType::Delete);
                times.push(Instant::now());
            }
        }
        times
    };
    let (report, times) = tokio::join!(gc.round(&term), deletions);
    let took = started.elapsed();
    assert_eq!(report.unwrap().deleted, 60);
    // 60 deletions at 20/s with a burst of 2: about 2.9 s.
    assert!(took >= Duration::from_millis(2700), "took {took:?}");
    let most_in_a_second = times
        .iter()
        .map(|t| {
            times
                .iter()
                .filter(|u| **u >= *t && **u < *t + Duration::from_secs(1))
                .count()
        })
        .max()
        .unwrap();
    // Events are timed as the watch delivers them: allow a little bunching.
    assert!(
        most_in_a_second <= (RATE + RATE / 4) as usize,
        "{most_in_a_second} deletions within one second"
    );
    let left = c
        .get(layout.id_prefix(), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert_eq!(left.count(), 0);
}

/// A round that fails midway (here: its term lapses during the deletes)
/// remembers nothing: the retry, seconds later, must not count it as the
/// first of two rounds.
#[tokio::test]
async fn a_round_that_fails_midway_counts_for_nothing() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let mut c = raw(&etcd).await;
    let layout = Layout::default();
    for id in 300..320 {
        c.put(layout.id_key(id), format!("k8s:app=n{id}"), None).await.unwrap();
    }
    let (mut gc, _) = new_gc(c.clone(), 10);
    gc.round(&term()).await.unwrap();
    // A new unused identity, first seen by the round that fails.
    c.put(layout.id_key(400), "k8s:app=late", None).await.unwrap();
    let lapsing = Term::begin("test", 0, Instant::now() + Duration::from_millis(500));
    assert!(matches!(gc.round(&lapsing).await, Err(GcError::NotLeading(_))));
    let left = c
        .get(
            layout.id_prefix(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .unwrap()
        .count();
    assert!((2..21).contains(&left), "some deleted before the lapse: {left} left");

    let retry = gc.round(&term()).await.unwrap();
    assert_eq!(retry.deleted, 0, "{retry:?}");
    assert_eq!(master(&mut c, 400).await.as_deref(), Some("k8s:app=late"));
    assert_eq!(retry.candidates, usize::try_from(left).unwrap());
}
