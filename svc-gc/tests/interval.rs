//! The collector over real pinned maps: the interval follows the adaptive
//! rule for chosen delete ratios (also for early passes, scaled by the time
//! actually elapsed), and map pressure starts a pass early.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rivet_testkit::gc::{TestMaps, synthetic_entries, synthetic_key};
use svc_gc::classify::Timeouts;
use svc_gc::clock::{Clock, KernelClock};
use svc_gc::collector::{Collector, CollectorOptions, CollectorStatus};
use svc_gc::endpoints::NoEndpoints;
use svc_gc::events::GcMetrics;
use svc_gc::interval::IntervalBounds;
use svc_gc::map::BatchMode;
use svc_gc::pass::Trigger;

fn options(start: Duration) -> CollectorOptions {
    CollectorOptions {
        timeouts: Timeouts::default(),
        start_interval: start,
        bounds: IntervalBounds {
            min: Duration::from_secs(10),
            max: Duration::from_secs(3600),
        },
        pressure_threshold: 1.0,
        ..CollectorOptions::default()
    }
}

fn collector(maps: &TestMaps, opts: CollectorOptions) -> Collector {
    Collector::new(
        opts,
        maps.gc_maps(BatchMode::Auto),
        Arc::new(NoEndpoints),
        Arc::new(KernelClock::new()),
        GcMetrics::default(),
    )
}

async fn wait_for(gc: &Collector, what: &str, pred: impl Fn(&CollectorStatus) -> bool) -> CollectorStatus {
    let started = Instant::now();
    loop {
        let status = gc.status();
        if pred(&status) {
            return status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn close(a: Duration, b: Duration) -> bool {
    a.abs_diff(b) < Duration::from_millis(5)
}

#[tokio::test]
async fn the_interval_follows_the_rule_for_chosen_delete_ratios() {
    // (expired of 1000, interval after the initial pass from 300 s)
    let cases = [
        (0, 450),   // nothing deleted: ×1.5
        (30, 450),  // 3%: ×1.5
        (100, 300), // 10%: unchanged
        (250, 300), // 25%: unchanged
        (500, 150), // 50%: ×0.5
        (800, 60),  // 80%: ×0.2
        (950, 30),  // 95%: capped at 90%, ×0.1
    ];
    for (expired, expected) in cases {
        let maps = TestMaps::create("ratio", 2048, 64).unwrap();
        let now = KernelClock::new().monotonic_nanos();
        let (keys, values) = synthetic_entries(now, 1000 - expired, expired, 21_600);
        maps.ct4().insert_all(&keys, &values).unwrap();
        let gc = collector(&maps, options(Duration::from_secs(300)));
        let controllers = rivet_common::controller::Controllers::new();
        gc.start(&controllers);
        let status = wait_for(&gc, "the initial pass", |s| s.passes >= 1).await;
        controllers.shutdown().await;
        let pass = status.last_pass.unwrap();
        assert_eq!(pass.trigger, Trigger::Initial);
        assert_eq!(pass.deleted.expired, u64::from(expired));
        assert_eq!(pass.scanned, 1000);
        assert!(
            close(status.interval, Duration::from_secs(expected)),
            "{expired}/1000 expired: interval {:?}, expected {expected} s",
            status.interval
        );
        // The next pass is one interval after this one started.
        let next_in = Duration::from_nanos((status.next_pass_unix_nanos - pass.started_unix_nanos).max(0) as u64);
        assert!(
            next_in.abs_diff(status.interval) < Duration::from_millis(500),
            "{next_in:?}"
        );
    }
}

#[tokio::test]
async fn bounds_hold_and_early_passes_are_scaled_by_the_time_elapsed() {
    let maps = TestMaps::create("scaled", 4096, 64).unwrap();
    let clock = KernelClock::new();
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), 1000, 0, 21_600);
    let mut ct4 = maps.ct4();
    ct4.insert_all(&keys, &values).unwrap();
    let gc = collector(&maps, options(Duration::from_secs(3000)));
    let controllers = rivet_common::controller::Controllers::new();
    gc.start(&controllers);
    let status = wait_for(&gc, "the initial pass", |s| s.passes >= 1).await;
    assert_eq!(status.interval, Duration::from_secs(3600), "×1.5 capped at the maximum");

    // 2% deleted right after the previous pass: over a whole interval that
    // would have been far more than 25% → shortened as for 90%.
    let (_, idle_values) = synthetic_entries(clock.monotonic_nanos(), 0, 20, 21_600);
    let idle_keys: Vec<_> = (0..20).map(|i| synthetic_key(5000 + i)).collect();
    ct4.insert_all(&idle_keys, &idle_values).unwrap();
    let pass = gc.run_now(Duration::from_secs(30)).await.unwrap();
    assert_eq!(pass.trigger, Trigger::RunNow);
    assert_eq!(pass.deleted.expired, 20);
    let status = gc.status();
    assert!(
        close(status.interval, Duration::from_secs(360)),
        "{:?}",
        status.interval
    );

    // Nothing deleted: lengthened, whenever it ran.
    let pass = gc.run_now(Duration::from_secs(30)).await.unwrap();
    assert_eq!(pass.deleted.total(), 0);
    assert!(
        close(gc.status().interval, Duration::from_secs(540)),
        "{:?}",
        gc.status().interval
    );

    // Floor: a ratio of 90% (scaled) from 10 s stays at 10 s.
    controllers.shutdown().await;
    let gc = collector(
        &maps,
        CollectorOptions {
            start_interval: Duration::from_secs(12),
            ..options(Duration::from_secs(12))
        },
    );
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), 100, 900, 21_600);
    ct4.insert_all(&keys, &values).unwrap();
    let controllers = rivet_common::controller::Controllers::new();
    gc.start(&controllers);
    let status = wait_for(&gc, "the initial pass", |s| s.passes >= 1).await;
    assert_eq!(status.last_pass.unwrap().deleted.expired, 900);
    assert_eq!(status.interval, Duration::from_secs(10), "never below the minimum");
    controllers.shutdown().await;
}

#[tokio::test]
async fn map_pressure_starts_a_pass_early() {
    let maps = TestMaps::create("pressure", 1024, 64).unwrap();
    let clock = KernelClock::new();
    let opts = CollectorOptions {
        bounds: IntervalBounds {
            min: Duration::from_millis(300),
            max: Duration::from_secs(3600),
        },
        pressure_threshold: 0.8,
        pressure_check: Duration::from_millis(100),
        ..options(Duration::from_secs(3600))
    };

    // Half full: no early pass.
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), 500, 0, 21_600);
    let mut ct4 = maps.ct4();
    ct4.insert_all(&keys, &values).unwrap();
    let gc = collector(&maps, opts.clone());
    let controllers = rivet_common::controller::Controllers::new();
    gc.start(&controllers);
    let initial = wait_for(&gc, "the initial pass", |s| s.passes >= 1).await;
    // A pass the fill calls for starts before the next check: after three
    // checks, one would have run.
    let checked = wait_for(&gc, "three fill checks", |s| s.fill_checks >= initial.fill_checks + 3).await;
    assert_eq!(checked.passes, 1, "no pressure at 50%");

    // 93% full: a map-pressure pass within a few checks.
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), 950, 0, 21_600);
    ct4.insert_all(&keys, &values).unwrap();
    let pressed = wait_for(&gc, "a map-pressure pass", |s| s.passes >= 2).await;
    let first = pressed.last_pass.clone().unwrap();
    assert_eq!(first.trigger, Trigger::MapPressure);
    // Live entries stay above the threshold: every check asks for a pass,
    // and passes keep at least the minimum interval (300 ms) apart.
    let later = wait_for(&gc, "three more map-pressure passes", |s| {
        s.passes >= pressed.passes + 3
    })
    .await;
    let last = later.last_pass.unwrap();
    assert_eq!(last.trigger, Trigger::MapPressure);
    let gaps = (later.passes - pressed.passes) as u32;
    let span = Duration::from_nanos((last.started_unix_nanos - first.started_unix_nanos).max(0) as u64);
    assert!(
        span + Duration::from_millis(20) * gaps >= Duration::from_millis(300) * gaps,
        "{gaps} passes in {span:?} with a 300 ms floor (checks every 100 ms)"
    );
    controllers.shutdown().await;
}

#[tokio::test]
async fn a_full_service_flow_map_starts_a_pass_early() {
    use rivet_datapath::maps::{Ct4Key, LB_FLOW_FORWARD, LbFlow};
    use rivet_datapath::spec;
    use svc_gc::map::PinnedMap;

    let maps = TestMaps::create("lbpressure", 1024, 1024)
        .unwrap()
        .with_service_maps(64)
        .unwrap();
    let opts = CollectorOptions {
        bounds: IntervalBounds {
            min: Duration::from_millis(300),
            max: Duration::from_secs(3600),
        },
        pressure_threshold: 0.8,
        pressure_check: Duration::from_millis(100),
        ..options(Duration::from_secs(3600))
    };
    let gc = collector(&maps, opts);
    let controllers = rivet_common::controller::Controllers::new();
    gc.start(&controllers);
    let initial = wait_for(&gc, "the initial pass", |s| s.passes >= 1).await;
    let checked = wait_for(&gc, "three fill checks", |s| s.fill_checks >= initial.fill_checks + 3).await;
    assert_eq!(checked.passes, 1, "no pressure while empty");

    // 60 live flows in a map of 64: a map-pressure pass.
    let mut lb4: PinnedMap<Ct4Key, LbFlow> =
        PinnedMap::open(maps.pin_dir(), &spec::LB4_FLOWS, BatchMode::Auto).unwrap();
    let live = KernelClock::new().monotonic_nanos() + 3_600_000_000_000;
    let keys: Vec<Ct4Key> = (0..60)
        .map(|i| {
            let mut k = synthetic_key(i);
            k.direction = LB_FLOW_FORWARD;
            k
        })
        .collect();
    let values = vec![
        LbFlow {
            expires: live,
            ..LbFlow::default()
        };
        keys.len()
    ];
    lb4.insert_all(&keys, &values).unwrap();
    let pressed = wait_for(&gc, "a map-pressure pass", |s| s.passes >= 2).await;
    assert_eq!(pressed.last_pass.unwrap().trigger, Trigger::MapPressure);
    controllers.shutdown().await;
}
