//! Passes over the datapath's real maps, pinned in a test bpffs directory
//! and filled with synthetic entries: expired (per protocol and TCP state),
//! live, orphaned (address of no endpoint) and refreshed during the pass. A
//! pass removes exactly the expected ones, by reason, with batches and with
//! the per-element fallback; no orphan goes without a complete, non-empty
//! endpoint list.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddrV4, SocketAddrV6};
use std::sync::Arc;
use std::time::Duration;

use rivet_datapath::maps::{
    CT_TCP_CLOSING, CT_TCP_ESTABLISHED, CT_TCP_SYN, Ct4Key, Ct6Key, CtEntry, DIR_EGRESS, DIR_INGRESS,
};
use rivet_datapath::spec::{self, MapDef};
use rivet_testkit::gc::{SECOND, TestMaps, entry, synthetic_entries};
use svc_gc::classify::{CtRules, LocalEndpoints, Timeouts};
use svc_gc::clock::{Clock, KernelClock};
use svc_gc::collector::{Collector, CollectorOptions};
use svc_gc::endpoints::{EndpointList, EndpointListError, StaticEndpoints};
use svc_gc::events::GcMetrics;
use svc_gc::interval::IntervalBounds;
use svc_gc::map::{BatchMode, DeleteOutcome, EntryMap, MapError, PinnedMap};
use svc_gc::pass::{CtMap, GcMaps, MapReport, OrphanCheck, PassPlan, Slot, Trigger, run_pass};

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const ICMP6: u8 = 58;
const LONG: u32 = 21_600;

fn timeouts() -> Timeouts {
    Timeouts {
        tcp_syn: Duration::from_secs(5),
        tcp_established: Duration::from_secs(100),
        tcp_closing: Duration::from_secs(2),
        udp: Duration::from_secs(30),
        icmp: Duration::from_secs(10),
    }
}

/// A first RunNow pass by the timeouts alone (no endpoint list, so no
/// orphan check).
fn timeouts_only_plan() -> PassPlan {
    PassPlan {
        number: 1,
        trigger: Trigger::RunNow,
        rules: CtRules {
            timeouts: timeouts(),
            endpoints: None,
        },
        orphan_check: OrphanCheck::SkippedListEmpty,
    }
}

fn k4(src: &str, dst: &str, protocol: u8, direction: u8) -> Ct4Key {
    Ct4Key::new(
        src.parse::<SocketAddrV4>().unwrap(),
        dst.parse::<SocketAddrV4>().unwrap(),
        protocol,
        direction,
    )
}

fn k6(src: &str, dst: &str, protocol: u8, direction: u8) -> Ct6Key {
    Ct6Key::new(
        src.parse::<SocketAddrV6>().unwrap(),
        dst.parse::<SocketAddrV6>().unwrap(),
        protocol,
        direction,
    )
}

/// What each synthetic entry should become.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Kept,
    Expired,
    Orphaned,
    /// Deletable when read, refreshed by the "datapath" before its delete.
    Refreshed,
}

struct Scenario<K> {
    entries: Vec<(K, CtEntry, Fate)>,
}

impl<K: Copy> Scenario<K> {
    fn keys(&self, fate: Fate) -> Vec<K> {
        self.entries.iter().filter(|e| e.2 == fate).map(|e| e.0).collect()
    }

    fn count(&self, fate: Fate) -> u64 {
        self.entries.iter().filter(|e| e.2 == fate).count() as u64
    }
}

/// Pod A (198.18.0.2, 2001:2::2) exists; pod 9 (198.18.0.9, 2001:2::9) is gone.
fn scenario4(now: u64) -> Scenario<Ct4Key> {
    let ago = |s: u64| now - s * SECOND;
    let old_format = |expires: u64| CtEntry {
        expires,
        tcp_state: CT_TCP_ESTABLISHED,
        ..CtEntry::default()
    };
    let entries = vec![
        // Live.
        (
            k4("198.18.0.2:40000", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(ago(1), LONG, CT_TCP_ESTABLISHED),
            Fate::Kept,
        ),
        (
            k4("198.19.0.1:5353", "198.18.0.2:53", UDP, DIR_INGRESS),
            entry(ago(5), 60, 0),
            Fate::Kept,
        ),
        // Idle 50 s: fine for established TCP (100 s) ...
        (
            k4("198.18.0.2:40001", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(ago(50), LONG, CT_TCP_ESTABLISHED),
            Fate::Kept,
        ),
        // ... but not for UDP (30 s), closing TCP (2 s), SYN (5 s) or ICMP (10 s).
        (
            k4("198.18.0.2:40002", "198.19.0.1:53", UDP, DIR_EGRESS),
            entry(ago(40), 60, 0),
            Fate::Expired,
        ),
        (
            k4("198.18.0.2:40003", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(ago(4), LONG, CT_TCP_CLOSING),
            Fate::Expired,
        ),
        (
            k4("198.18.0.2:40004", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(ago(10), LONG, CT_TCP_SYN),
            Fate::Expired,
        ),
        (
            k4("198.18.0.2:7", "198.19.0.1:7", ICMP, DIR_EGRESS),
            entry(ago(20), 60, 0),
            Fate::Expired,
        ),
        // The datapath's own deadline passed (lifetime 20 s, idle 25 s).
        (
            k4("198.18.0.2:40005", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(ago(25), 20, CT_TCP_ESTABLISHED),
            Fate::Expired,
        ),
        // An entry of an older datapath (no lifetime): only `expires` counts.
        (
            k4("198.18.0.2:40006", "198.19.0.1:80", TCP, DIR_EGRESS),
            old_format(ago(3)),
            Fate::Expired,
        ),
        (
            k4("198.18.0.9:40007", "198.19.0.1:80", TCP, DIR_EGRESS),
            old_format(now + 1000 * SECOND),
            Fate::Kept,
        ),
        // Orphans: the local side is gone (egress: source; ingress: destination).
        (
            k4("198.18.0.9:40008", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(ago(5), LONG, CT_TCP_ESTABLISHED),
            Fate::Orphaned,
        ),
        (
            k4("198.18.0.2:40009", "198.18.0.9:80", TCP, DIR_INGRESS),
            entry(ago(5), LONG, CT_TCP_ESTABLISHED),
            Fate::Orphaned,
        ),
        // The gone address on the remote side: not an orphan.
        (
            k4("198.18.0.9:40010", "198.18.0.2:80", TCP, DIR_INGRESS),
            entry(ago(5), LONG, CT_TCP_ESTABLISHED),
            Fate::Kept,
        ),
        (
            k4("198.18.0.2:40011", "198.18.0.9:80", TCP, DIR_EGRESS),
            entry(ago(5), LONG, CT_TCP_ESTABLISHED),
            Fate::Kept,
        ),
        // Refreshed after the endpoint list was taken: maybe a new endpoint's.
        (
            k4("198.18.0.9:40012", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(now + 2 * SECOND, LONG, CT_TCP_ESTABLISHED),
            Fate::Kept,
        ),
        // Deletable, then refreshed during the pass (one expired, one orphaned).
        (
            k4("198.18.0.2:40013", "198.19.0.1:53", UDP, DIR_EGRESS),
            entry(ago(40), 60, 0),
            Fate::Refreshed,
        ),
        (
            k4("198.18.0.9:40014", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(ago(5), LONG, CT_TCP_ESTABLISHED),
            Fate::Refreshed,
        ),
    ];
    Scenario { entries }
}

fn scenario6(now: u64) -> Scenario<Ct6Key> {
    let ago = |s: u64| now - s * SECOND;
    let entries = vec![
        (
            k6("[2001:2::2]:40000", "[2001:2:0:1::1]:443", TCP, DIR_EGRESS),
            entry(ago(1), LONG, CT_TCP_ESTABLISHED),
            Fate::Kept,
        ),
        (
            k6("[2001:2::2]:40001", "[2001:2:0:1::1]:53", UDP, DIR_EGRESS),
            entry(ago(31), 60, 0),
            Fate::Expired,
        ),
        (
            k6("[2001:2::2]:9", "[2001:2:0:1::1]:9", ICMP6, DIR_EGRESS),
            entry(ago(11), 60, 0),
            Fate::Expired,
        ),
        (
            k6("[2001:2:0:1::1]:40002", "[2001:2::9]:80", TCP, DIR_INGRESS),
            entry(ago(5), LONG, CT_TCP_ESTABLISHED),
            Fate::Orphaned,
        ),
        (
            k6("[2001:2::9]:40003", "[2001:2::2]:80", TCP, DIR_INGRESS),
            entry(ago(5), LONG, CT_TCP_ESTABLISHED),
            Fate::Kept,
        ),
        (
            k6("[2001:2::2]:40004", "[2001:2:0:1::1]:53", UDP, DIR_EGRESS),
            entry(ago(40), 60, 0),
            Fate::Refreshed,
        ),
    ];
    Scenario { entries }
}

fn endpoints(listed_at: u64) -> LocalEndpoints {
    LocalEndpoints {
        addrs: ["198.18.0.2", "2001:2::2"]
            .iter()
            .map(|a| a.parse::<IpAddr>().unwrap())
            .collect(),
        listed_at,
    }
}

/// A map that behaves like the datapath refreshing some entries right after
/// the pass read them: after the first chunk, it rewrites `refresh` in the
/// real pinned map through its own handle.
struct RefreshDuringPass<K: aya::Pod + PartialEq + Send> {
    inner: PinnedMap<K, CtEntry>,
    writer: PinnedMap<K, CtEntry>,
    refresh: Vec<(K, CtEntry)>,
    chunks: u32,
}

impl<K: aya::Pod + PartialEq + Send> EntryMap for RefreshDuringPass<K> {
    type Key = K;
    type Value = CtEntry;

    fn name(&self) -> &str {
        self.inner.name()
    }
    fn max_entries(&self) -> u32 {
        self.inner.max_entries()
    }
    fn batched(&self) -> bool {
        self.inner.batched()
    }
    fn begin_scan(&mut self) {
        self.inner.begin_scan();
    }
    fn next_chunk(&mut self, keys: &mut Vec<K>, values: &mut Vec<CtEntry>) -> Result<bool, MapError> {
        let more = self.inner.next_chunk(keys, values)?;
        self.chunks += 1;
        if self.chunks == 1 {
            for (key, value) in &self.refresh {
                self.writer.insert(key, value)?;
            }
        }
        Ok(more)
    }
    fn lookup(&mut self, key: &K) -> Result<Option<CtEntry>, MapError> {
        self.inner.lookup(key)
    }
    fn delete(&mut self, keys: &[K]) -> Result<DeleteOutcome, MapError> {
        self.inner.delete(keys)
    }
    fn estimate_len(&mut self) -> Result<u64, MapError> {
        self.inner.estimate_len()
    }
}

/// The refreshed version of an entry: a packet now, counters bumped.
fn refreshed(e: &CtEntry, now: u64) -> CtEntry {
    CtEntry {
        expires: now + u64::from(e.lifetime) * SECOND,
        packets_fwd: e.packets_fwd + 1,
        bytes_fwd: e.bytes_fwd + 60,
        ..*e
    }
}

fn slot<K: svc_gc::classify::CtKey + 'static>(
    maps: &TestMaps,
    def: &'static MapDef,
    mode: BatchMode,
    refresh: Vec<(K, CtEntry)>,
) -> Slot<K> {
    let dir = maps.pin_dir().to_owned();
    let mut refresh = Some(refresh);
    Slot::new(
        def.name,
        Box::new(move || {
            Ok(Box::new(RefreshDuringPass {
                inner: PinnedMap::open(&dir, def, mode)?,
                writer: PinnedMap::open(&dir, def, BatchMode::Auto)?,
                refresh: refresh.take().unwrap_or_default(),
                chunks: 0,
            }) as CtMap<K>)
        }),
    )
}

fn fill<K: aya::Pod + PartialEq + Send>(map: &mut PinnedMap<K, CtEntry>, s: &Scenario<K>) {
    let keys: Vec<K> = s.entries.iter().map(|e| e.0).collect();
    let values: Vec<CtEntry> = s.entries.iter().map(|e| e.1).collect();
    map.insert_all(&keys, &values).unwrap();
}

fn check<K>(report: &MapReport, map: &mut PinnedMap<K, CtEntry>, s: &Scenario<K>, refreshed_values: &[(K, CtEntry)])
where
    K: aya::Pod + PartialEq + Send + Ord + std::fmt::Debug,
{
    assert_eq!(report.error, None, "{report:?}");
    assert_eq!(report.scanned, s.entries.len() as u64, "{report:?}");
    assert_eq!(report.deleted.expired, s.count(Fate::Expired), "{report:?}");
    assert_eq!(report.deleted.orphaned_endpoint, s.count(Fate::Orphaned), "{report:?}");
    assert_eq!(report.deleted.nat_without_connection, 0);
    assert_eq!(report.spared_refreshed, s.count(Fate::Refreshed), "{report:?}");
    let left: BTreeMap<K, CtEntry> = map.dump().unwrap().into_iter().collect();
    let mut expected: BTreeMap<K, CtEntry> = s
        .entries
        .iter()
        .filter(|e| e.2 == Fate::Kept)
        .map(|e| (e.0, e.1))
        .collect();
    expected.extend(refreshed_values.iter().copied());
    assert_eq!(
        left, expected,
        "exactly the kept and the refreshed entries are left, unchanged"
    );
    assert_eq!(report.remaining, left.len() as u64);
    for gone in s.keys(Fate::Expired).iter().chain(&s.keys(Fate::Orphaned)) {
        assert!(!left.contains_key(gone), "{gone:?} must be deleted");
    }
}

fn sweep(mode: BatchMode) {
    let maps = TestMaps::create("sweep", 4096, 4096).unwrap();
    let clock = KernelClock::new();
    let now = clock.monotonic_nanos();
    let (s4, s6) = (scenario4(now), scenario6(now));
    let (mut ct4, mut ct6) = (maps.ct4(), maps.ct6());
    fill(&mut ct4, &s4);
    fill(&mut ct6, &s6);
    let r4: Vec<(Ct4Key, CtEntry)> = s4
        .entries
        .iter()
        .filter(|e| e.2 == Fate::Refreshed)
        .map(|e| (e.0, refreshed(&e.1, now)))
        .collect();
    let r6: Vec<(Ct6Key, CtEntry)> = s6
        .entries
        .iter()
        .filter(|e| e.2 == Fate::Refreshed)
        .map(|e| (e.0, refreshed(&e.1, now)))
        .collect();
    let mut gc = GcMaps {
        ct4: slot(&maps, &spec::CT4, mode, r4.clone()),
        ct6: slot(&maps, &spec::CT6, mode, r6.clone()),
        services: None,
    };
    let plan = PassPlan {
        number: 1,
        trigger: Trigger::RunNow,
        rules: CtRules {
            timeouts: timeouts(),
            endpoints: Some(endpoints(now)),
        },
        orphan_check: OrphanCheck::Done,
    };
    let report = run_pass(&mut gc, &plan, &clock).unwrap();
    assert_eq!(report.maps.len(), 2);
    for m in &report.maps {
        assert_eq!(m.batched, mode == BatchMode::Auto, "{m:?}");
        assert_eq!(m.max_entries, 4096);
    }
    check(&report.maps[0], &mut ct4, &s4, &r4);
    check(&report.maps[1], &mut ct6, &s6, &r6);
    assert_eq!(
        report.deleted.expired,
        s4.count(Fate::Expired) + s6.count(Fate::Expired)
    );
    assert_eq!(report.deleted.orphaned_endpoint, 3);
    let expected_ratio = report.deleted.total() as f64 / (s4.entries.len() + s6.entries.len()) as f64;
    assert!((report.delete_ratio - expected_ratio).abs() < 1e-9);

    // A second pass finds nothing more to delete (the refreshed entries are
    // live now), and leaves everything in place.
    let again = run_pass(&mut gc, &PassPlan { number: 2, ..plan }, &clock).unwrap();
    assert_eq!(again.deleted.total(), 0, "{again:?}");
    assert_eq!(again.maps.iter().map(|m| m.spared_refreshed).sum::<u64>(), 0);
}

#[test]
fn a_pass_deletes_exactly_the_expired_and_orphaned_entries_with_batches() {
    sweep(BatchMode::Auto);
}

#[test]
fn the_per_element_fallback_deletes_the_same() {
    sweep(BatchMode::Never);
}

#[test]
fn without_a_usable_endpoint_list_no_orphan_is_deleted() {
    let maps = TestMaps::create("nolist", 1024, 1024).unwrap();
    let clock = KernelClock::new();
    let now = clock.monotonic_nanos();
    let s4 = scenario4(now);
    let mut ct4 = maps.ct4();
    fill(&mut ct4, &s4);
    let rules = CtRules {
        timeouts: timeouts(),
        endpoints: None,
    };
    let mut gc = maps.gc_maps(BatchMode::Auto);
    let plan = PassPlan {
        number: 1,
        trigger: Trigger::Interval,
        rules,
        orphan_check: OrphanCheck::SkippedListFailed,
    };
    let report = run_pass(&mut gc, &plan, &clock).unwrap();
    // The "refreshed" ones are not refreshed here: the expired one goes.
    assert_eq!(report.deleted.expired, s4.count(Fate::Expired) + 1);
    assert_eq!(report.deleted.orphaned_endpoint, 0);
    let left: HashSet<Ct4Key> = ct4.dump().unwrap().into_iter().map(|(k, _)| k).collect();
    for orphan in s4.keys(Fate::Orphaned) {
        assert!(left.contains(&orphan), "no orphan may go without a list");
    }
}

fn collector(maps: &TestMaps, list: EndpointList, opts: CollectorOptions) -> Collector {
    Collector::new(
        opts,
        maps.gc_maps(BatchMode::Auto),
        Arc::new(StaticEndpoints(list)),
        Arc::new(KernelClock::new()),
        GcMetrics::default(),
    )
}

fn quiet() -> CollectorOptions {
    CollectorOptions {
        timeouts: timeouts(),
        start_interval: Duration::from_secs(300),
        bounds: IntervalBounds {
            min: Duration::from_secs(10),
            max: Duration::from_secs(3600),
        },
        pressure_threshold: 1.0,
        ..CollectorOptions::default()
    }
}

#[tokio::test]
async fn orphan_checks_follow_the_endpoint_list() {
    let cases = [
        (
            EndpointList::Failed(EndpointListError::Call(
                tonic::Status::unavailable("svc-endpoint down").into(),
            )),
            OrphanCheck::SkippedListFailed,
            0,
        ),
        (EndpointList::Restoring, OrphanCheck::SkippedRestoring, 0),
        (EndpointList::Complete(HashSet::new()), OrphanCheck::SkippedListEmpty, 0),
        (
            EndpointList::Complete(endpoints(0).addrs),
            OrphanCheck::Done,
            // Both orphans and the two "refreshed" ones (not refreshed here).
            3,
        ),
    ];
    for (list, check, orphans) in cases {
        let maps = TestMaps::create("orphans", 1024, 1024).unwrap();
        let now = KernelClock::new().monotonic_nanos();
        let s4 = scenario4(now);
        fill(&mut maps.ct4(), &s4);
        let gc = collector(&maps, list, quiet());
        let controllers = rivet_common::controller::Controllers::new();
        gc.start(&controllers);
        let pass = gc.run_now(Duration::from_secs(30)).await.unwrap();
        controllers.shutdown().await;
        assert_eq!(pass.orphan_check, check);
        assert_eq!(pass.deleted.orphaned_endpoint, orphans, "{check:?}: {pass:?}");
        assert_eq!(pass.deleted.expired, s4.count(Fate::Expired) + 1, "{check:?}");
    }
}

#[tokio::test]
async fn without_maps_run_now_is_unavailable_until_they_are_pinned() {
    let maps = TestMaps::create("absent", 1024, 1024).unwrap();
    maps.remove().unwrap();
    let gc = Collector::new(
        CollectorOptions {
            retry: Duration::from_millis(100),
            ..quiet()
        },
        maps.gc_maps(BatchMode::Auto),
        Arc::new(StaticEndpoints(EndpointList::Restoring)),
        Arc::new(KernelClock::new()),
        GcMetrics::default(),
    );
    let controllers = rivet_common::controller::Controllers::new();
    gc.start(&controllers);
    let err = gc.run_now(Duration::from_secs(30)).await.unwrap_err();
    assert!(err.to_string().contains("no map could be opened"), "{err}");
    let status = gc.status();
    assert!(status.last_pass.is_none());
    assert_eq!(status.passes, 0);
    assert_eq!(
        status.totals.iter().map(|t| t.0.as_str()).collect::<Vec<_>>(),
        ["ct4", "ct6", "lb4_flows", "lb6_flows", "lb_affinity", "lb_sock_rev"]
    );

    // svc-loader pins the maps: the retry is the initial pass.
    maps.recreate().unwrap();
    let (keys, values) = synthetic_entries(KernelClock::new().monotonic_nanos(), 2, 1, 60);
    maps.ct4().insert_all(&keys, &values).unwrap();
    let started = std::time::Instant::now();
    while gc.status().passes == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no pass after the maps appeared"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pass = gc.status().last_pass.unwrap();
    assert_eq!(pass.trigger, Trigger::Initial);
    assert_eq!((pass.scanned, pass.deleted.expired), (3, 1));
    controllers.shutdown().await;
}

#[test]
fn a_map_replaced_under_its_pin_is_reopened() {
    let maps = TestMaps::create("reopen", 1024, 1024).unwrap();
    let clock = KernelClock::new();
    let mut gc = maps.gc_maps(BatchMode::Auto);
    let plan = PassPlan {
        number: 1,
        trigger: Trigger::Interval,
        rules: CtRules {
            timeouts: timeouts(),
            endpoints: None,
        },
        orphan_check: OrphanCheck::SkippedListFailed,
    };
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), 3, 2, 60);
    maps.ct4().insert_all(&keys, &values).unwrap();
    let first = run_pass(&mut gc, &plan, &clock).unwrap();
    assert_eq!((first.scanned, first.deleted.expired), (5, 2));

    let old_id = maps.ct4().id();
    maps.recreate().unwrap();
    assert_ne!(maps.ct4().id(), old_id);
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), 1, 4, 60);
    maps.ct4().insert_all(&keys, &values).unwrap();
    let second = run_pass(&mut gc, &plan, &clock).unwrap();
    assert_eq!(
        (second.scanned, second.deleted.expired),
        (5, 4),
        "the new map is swept: {second:?}"
    );
    assert_eq!(maps.ct4().dump().unwrap().len(), 1);
}

#[test]
fn fill_estimates_are_close_and_cheap() {
    let maps = TestMaps::create("estimate", 262_144, 64).unwrap();
    let mut ct4 = maps.ct4();
    let now = KernelClock::new().monotonic_nanos();
    for (n, total) in [(0u32, 0u32), (20_000, 20_000), (130_000, 150_000), (100_000, 250_000)] {
        let (keys, values) = synthetic_entries(now, n, 0, LONG);
        let keys: Vec<Ct4Key> = keys
            .iter()
            .enumerate()
            .map(|(i, _)| rivet_testkit::gc::synthetic_key(total - n + i as u32))
            .collect();
        ct4.insert_all(&keys, &values).unwrap();
        let started = std::time::Instant::now();
        let estimate = ct4.estimate_len().unwrap();
        let took = started.elapsed();
        let error = (estimate as f64 - f64::from(total)).abs();
        assert!(
            error <= f64::from(total) * 0.1 + 50.0,
            "{total} entries estimated as {estimate}"
        );
        assert!(took < Duration::from_millis(200), "{took:?}");
        eprintln!("{total} entries: estimate {estimate} in {took:?}");
    }
    let mut per_entry = PinnedMap::<Ct4Key, CtEntry>::open(maps.pin_dir(), &spec::CT4, BatchMode::Never).unwrap();
    assert!(per_entry.estimate_len().is_err(), "no estimate without batches");
}

#[test]
fn entries_expire_as_the_clock_moves_on() {
    let maps = TestMaps::create("clock", 1024, 64).unwrap();
    let clock = svc_gc::clock::ShiftedClock::new();
    let now = clock.monotonic_nanos();
    // Established (100 s timeout) and UDP (30 s) flows, refreshed just now.
    let entries = [
        (
            k4("198.18.0.2:40000", "198.19.0.1:80", TCP, DIR_EGRESS),
            entry(now, LONG, CT_TCP_ESTABLISHED),
        ),
        (
            k4("198.18.0.2:40001", "198.19.0.1:53", UDP, DIR_EGRESS),
            entry(now, 60, 0),
        ),
    ];
    let mut ct4 = maps.ct4();
    for (k, v) in &entries {
        ct4.insert(k, v).unwrap();
    }
    let mut gc = maps.gc_maps(BatchMode::Auto);
    let mut pass = |number| {
        let plan = PassPlan {
            number,
            trigger: Trigger::Interval,
            rules: CtRules {
                timeouts: timeouts(),
                endpoints: None,
            },
            orphan_check: OrphanCheck::SkippedListFailed,
        };
        run_pass(&mut gc, &plan, &clock).unwrap().deleted.expired
    };
    assert_eq!(pass(1), 0);
    clock.advance(30 * SECOND as i64);
    assert_eq!(
        pass(2),
        0,
        "30 s idle: UDP's timeout plus the refresh slack not yet over"
    );
    clock.advance(2 * SECOND as i64);
    assert_eq!(pass(3), 1, "the UDP flow");
    clock.advance(70 * SECOND as i64);
    assert_eq!(pass(4), 1, "the TCP connection, 102 s idle");
    assert!(ct4.dump().unwrap().is_empty());
}

/// The service maps: translated flows past their deadline go, live ones
/// stay; affinity entries unused past their service's timeout go, and those
/// of a service with no frontend any more, unless used after the frontends
/// were read.
#[test]
fn a_pass_expires_service_flows_and_stale_affinity() {
    use rivet_datapath::maps::{
        LB_FLOW_FORWARD, LB_FLOW_REVERSE, LbAffinity, LbAffinityKey, LbFlow, LbFrontend, LbFrontendKey, SVC_F_AFFINITY,
        SVC_F_CLUSTER_IP, SVC_SCOPE_INTERNAL,
    };
    let maps = TestMaps::create("lb", 1024, 1024)
        .unwrap()
        .with_service_maps(1024)
        .unwrap();
    let dir = maps.pin_dir().to_owned();
    let clock = KernelClock::new();
    let now = clock.monotonic_nanos();
    let flow = |expires: u64| LbFlow {
        expires,
        lifetime: 60,
        service_id: 1,
        ..LbFlow::default()
    };
    let c4 = |port: u16, direction: u8| {
        Ct4Key::new(
            SocketAddrV4::new("198.18.0.2".parse().unwrap(), port),
            "198.19.128.1:80".parse().unwrap(),
            TCP,
            direction,
        )
    };
    let c6 = |port: u16| {
        Ct6Key::new(
            SocketAddrV6::new("2001:2::2".parse().unwrap(), port, 0, 0),
            "[2001:2:0:ff::1]:80".parse().unwrap(),
            UDP,
            LB_FLOW_FORWARD,
        )
    };
    let mut lb4: PinnedMap<Ct4Key, LbFlow> = PinnedMap::open(&dir, &spec::LB4_FLOWS, BatchMode::Auto).unwrap();
    let mut lb6: PinnedMap<Ct6Key, LbFlow> = PinnedMap::open(&dir, &spec::LB6_FLOWS, BatchMode::Auto).unwrap();
    let live4 = [
        (c4(1000, LB_FLOW_FORWARD), flow(now + 30 * SECOND)),
        (c4(1000, LB_FLOW_REVERSE), flow(now + 30 * SECOND)),
    ];
    let dead4 = [
        (c4(2000, LB_FLOW_FORWARD), flow(now - 5 * SECOND)),
        (c4(2000, LB_FLOW_REVERSE), flow(now - 5 * SECOND)),
    ];
    // Within the second of slack: kept.
    let slack4 = [(c4(3000, LB_FLOW_FORWARD), flow(now - SECOND / 2))];
    for (k, v) in live4.iter().chain(&dead4).chain(&slack4) {
        lb4.insert_all(&[*k], &[*v]).unwrap();
    }
    lb6.insert_all(&[c6(1), c6(2)], &[flow(now + 30 * SECOND), flow(now - 10 * SECOND)])
        .unwrap();

    // Service 1 has affinity for 10 s; service 2 has frontends without
    // affinity; service 3 is gone.
    let mut frontends: PinnedMap<LbFrontendKey, LbFrontend> =
        PinnedMap::open(&dir, &spec::LB_FRONTENDS, BatchMode::Auto).unwrap();
    let fe = |id: u32, flags: u16, timeout: u32| LbFrontend {
        service_id: id,
        table_id: id,
        backend_count: 1,
        flags,
        affinity_timeout: timeout,
    };
    frontends
        .insert_all(
            &[
                LbFrontendKey::vip("198.19.128.1:80".parse().unwrap(), TCP, SVC_SCOPE_INTERNAL),
                LbFrontendKey::vip("198.19.128.2:80".parse().unwrap(), TCP, SVC_SCOPE_INTERNAL),
            ],
            &[fe(1, SVC_F_CLUSTER_IP | SVC_F_AFFINITY, 10), fe(2, SVC_F_CLUSTER_IP, 0)],
        )
        .unwrap();
    let mut affinity: PinnedMap<LbAffinityKey, LbAffinity> =
        PinnedMap::open(&dir, &spec::LB_AFFINITY, BatchMode::Auto).unwrap();
    let client = |n: u8| IpAddr::from([198, 18, 0, n]);
    let used = |at: u64| LbAffinity {
        last_used: at,
        backend_id: 5,
        pad: 0,
    };
    let fresh = (LbAffinityKey::new(client(2), 1), used(now - 5 * SECOND));
    let stale = (LbAffinityKey::new(client(3), 1), used(now - 20 * SECOND));
    let no_affinity = (LbAffinityKey::new(client(4), 2), used(now - SECOND));
    let gone = (LbAffinityKey::new(client(5), 3), used(now - SECOND));
    let new_service = (LbAffinityKey::new(client(6), 4), used(now + 3600 * SECOND));
    for (k, v) in [fresh, stale, no_affinity, gone, new_service] {
        affinity.insert_all(&[k], &[v]).unwrap();
    }

    let mut gc = maps.gc_maps(BatchMode::Auto);
    assert_eq!(
        gc.names(),
        ["ct4", "ct6", "lb4_flows", "lb6_flows", "lb_affinity", "lb_sock_rev"]
    );
    let plan = timeouts_only_plan();
    let report = run_pass(&mut gc, &plan, &clock).unwrap();
    let by_map: BTreeMap<&str, &MapReport> = report.maps.iter().map(|m| (m.map.as_str(), m)).collect();
    assert_eq!(by_map["lb4_flows"].deleted.expired, 2, "{report:?}");
    assert_eq!(by_map["lb4_flows"].remaining, 3);
    assert_eq!(by_map["lb6_flows"].deleted.expired, 1);
    let aff = by_map["lb_affinity"];
    assert_eq!(aff.error, None);
    assert_eq!((aff.deleted.expired, aff.deleted.service_gone), (2, 1), "{aff:?}");

    let left4: HashSet<Ct4Key> = lb4.dump().unwrap().into_iter().map(|(k, _)| k).collect();
    let want4: HashSet<Ct4Key> = live4.iter().chain(&slack4).map(|(k, _)| *k).collect();
    assert_eq!(left4, want4);
    assert_eq!(
        lb6.dump().unwrap().into_iter().map(|(k, _)| k).collect::<Vec<_>>(),
        [c6(1)]
    );
    let left: HashSet<LbAffinityKey> = affinity.dump().unwrap().into_iter().map(|(k, _)| k).collect();
    assert_eq!(left, HashSet::from([fresh.0, new_service.0]));
}

/// Socket-level load balancing's translations: a datagram entry (sendmsg
/// of an unconnected UDP socket) unused for longer than the UDP timeout
/// goes; a recently used one stays; a connected socket's entry stays
/// however old (its socket reads it only at getpeername), and so does an
/// entry of an older datapath (no flags; the service id where last_used is).
#[test]
fn a_pass_expires_unused_datagram_socket_translations_only() {
    use rivet_datapath::maps::{LB_SOCK_REV_F_DATAGRAM, LbSockRev, LbSockRevKey};
    let maps = TestMaps::create("sockrev", 1024, 1024)
        .unwrap()
        .with_service_maps(1024)
        .unwrap();
    let clock = KernelClock::new();
    let now_s = (clock.monotonic_nanos() / SECOND) as u32;
    let mut sock_rev: PinnedMap<LbSockRevKey, LbSockRev> =
        PinnedMap::open(maps.pin_dir(), &spec::LB_SOCK_REV, BatchMode::Auto).unwrap();
    let key = |cookie: u64| LbSockRevKey::new(cookie, "198.18.0.3:53".parse().unwrap());
    let value = |flags: u8, last_used: u32| LbSockRev {
        addr: [u32::from_ne_bytes([198, 19, 128, 10]), 0, 0, 0],
        port: 53u16.to_be(),
        family: 4,
        flags,
        last_used,
    };
    // The UDP timeout is 30 s (timeouts()).
    let stale_datagram = (key(1), value(LB_SOCK_REV_F_DATAGRAM, now_s - 40));
    let fresh_datagram = (key(2), value(LB_SOCK_REV_F_DATAGRAM, now_s - 10));
    let old_connected = (key(3), value(0, now_s - 3600));
    let older_datapath = (key(4), value(0, 7));
    for (k, v) in [stale_datagram, fresh_datagram, old_connected, older_datapath] {
        sock_rev.insert(&k, &v).unwrap();
    }

    let mut gc = maps.gc_maps(BatchMode::Auto);
    let plan = timeouts_only_plan();
    let report = run_pass(&mut gc, &plan, &clock).unwrap();
    let rev = report
        .maps
        .iter()
        .find(|m| m.map == "lb_sock_rev")
        .expect("lb_sock_rev is swept");
    assert_eq!(
        (rev.error.as_deref(), rev.deleted.expired, rev.remaining),
        (None, 1, 3),
        "{rev:?}"
    );
    let left: HashSet<LbSockRevKey> = sock_rev.dump().unwrap().into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        left,
        HashSet::from([fresh_datagram.0, old_connected.0, older_datapath.0])
    );
}
