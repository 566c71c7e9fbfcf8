//! One pass over the node's maps: read each in chunks, decide per entry,
//! re-check every entry about to go, delete in batches.
//!
//! # A live connection is never deleted
//!
//! Between reading a chunk and deleting from it, the datapath may refresh an
//! entry (a packet arrived). So every entry found deletable is looked up
//! again right before its delete, and kept — counted as `spared_refreshed` —
//! if its value changed in any way (a packet bumps the counters, a refresh
//! rewrites `expires`). The confirmed keys of a group of at most
//! [`DELETE_GROUP`] candidates then go in one `BPF_MAP_DELETE_BATCH`.
//!
//! The window this leaves is from an entry's re-check to the batch delete of
//! its group: at most [`DELETE_GROUP`] lookups, tens of microseconds. A packet
//! that lands in it finds its entry gone right after; since the entry had
//! been idle past its timeout when re-checked, that is the same as the packet
//! arriving just after a delete at the deadline, which no collector can
//! avoid: the connection's next packet is treated as new (policy decides
//! again and a new entry is created). No refresh made before the re-check is
//! ever lost.
//!
//! # The service maps
//!
//! After `ct4` and `ct6`, a pass sweeps the service maps that are pinned
//! ([`ServiceSlots`]): `lb4_flows` / `lb6_flows` by their deadline
//! ([`flow_verdict`]) and `lb_affinity` by its service's timeout read from
//! `lb_frontends` at the start of its sweep ([`AffinityRules`]), and
//! `lb_sock_rev`'s datagram entries by their last use
//! ([`sock_rev_verdict`]); the re-check and batch delete are the same
//! ([`sweep`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rivet_datapath::maps::{
    Ct4Key, Ct6Key, CtEntry, LbAffinity, LbAffinityKey, LbFlow, LbFrontend, LbFrontendKey, LbSockRev, LbSockRevKey,
};
use rivet_datapath::spec::{self, MapDef};

use crate::classify::{AffinityRules, CtKey, CtRules, Reason, Timeouts, flow_verdict, sock_rev_verdict};
use crate::clock::Clock;
use crate::map::{BatchMode, CHUNK, EntryMap, MapError, PinnedMap};

/// Candidates re-checked before one batch delete (bounds the window between
/// a re-check and the delete).
pub const DELETE_GROUP: usize = 128;

/// Why a pass ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trigger {
    /// The full pass at start.
    Initial,
    /// The adaptive interval elapsed.
    Interval,
    /// A RunNow call.
    RunNow,
    /// A map crossed its fill threshold.
    MapPressure,
}

impl Trigger {
    /// Label value for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Initial => "initial",
            Self::Interval => "interval",
            Self::RunNow => "run_now",
            Self::MapPressure => "map_pressure",
        }
    }
}

/// Whether a pass could delete entries of vanished endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OrphanCheck {
    /// The endpoint list was complete; orphans were deleted.
    Done,
    /// svc-endpoint unreachable or failed.
    SkippedListFailed,
    /// The list was empty.
    SkippedListEmpty,
    /// svc-endpoint was still restoring.
    SkippedRestoring,
}

impl OrphanCheck {
    /// Label value for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::SkippedListFailed => "skipped_list_failed",
            Self::SkippedListEmpty => "skipped_list_empty",
            Self::SkippedRestoring => "skipped_restoring",
        }
    }
}

/// Entries deleted, by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeletedCounts {
    /// Lifetime over.
    pub expired: u64,
    /// Address of no endpoint on the node.
    pub orphaned_endpoint: u64,
    /// NAT entry whose connection is gone.
    pub nat_without_connection: u64,
    /// Affinity entry of a service that is gone.
    pub service_gone: u64,
}

impl DeletedCounts {
    /// All reasons together.
    pub fn total(&self) -> u64 {
        self.expired + self.orphaned_endpoint + self.nat_without_connection + self.service_gone
    }

    /// Counts one more for `reason`.
    pub fn count(&mut self, reason: Reason) {
        match reason {
            Reason::Expired => self.expired += 1,
            Reason::OrphanedEndpoint => self.orphaned_endpoint += 1,
            Reason::NatWithoutConnection => self.nat_without_connection += 1,
            Reason::ServiceGone => self.service_gone += 1,
        }
    }

    /// Adds `other`.
    pub fn add(&mut self, other: &Self) {
        self.expired += other.expired;
        self.orphaned_endpoint += other.orphaned_endpoint;
        self.nat_without_connection += other.nat_without_connection;
        self.service_gone += other.service_gone;
    }
}

/// What a pass did to one map.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapReport {
    /// Pin name.
    pub map: String,
    /// Entries read.
    pub scanned: u64,
    /// Entries deleted, by reason.
    pub deleted: DeletedCounts,
    /// Deletable entries refreshed before their delete, so kept.
    pub spared_refreshed: u64,
    /// Deletable entries that were already gone at the re-check or the
    /// delete (the datapath or LRU eviction removed them).
    pub vanished: u64,
    /// Entries left: scanned − deleted − vanished (entries created during
    /// the pass behind the scan are not counted).
    pub remaining: u64,
    /// The map's max_entries (0 when it could not be opened).
    pub max_entries: u32,
    /// Batch commands were used.
    pub batched: bool,
    /// Time spent on this map.
    pub duration: Duration,
    /// Set when the map was not processed completely.
    pub error: Option<String>,
}

/// One pass.
#[derive(Clone, Debug, PartialEq)]
pub struct PassReport {
    /// From 1 within one process.
    pub number: u64,
    /// Why it ran.
    pub trigger: Trigger,
    /// Wall-clock start.
    pub started_unix_nanos: i64,
    /// Kernel monotonic start.
    pub started_monotonic: u64,
    /// How long it took.
    pub duration: Duration,
    /// Per map.
    pub maps: Vec<MapReport>,
    /// Sum over maps.
    pub scanned: u64,
    /// Sum over maps.
    pub deleted: DeletedCounts,
    /// deleted / scanned (0 when nothing was scanned).
    pub delete_ratio: f64,
    /// Whether orphans were deleted.
    pub orphan_check: OrphanCheck,
}

/// A pass that could not run at all.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PassError {
    /// No map could be opened (not pinned yet, wrong shape): why, per map.
    #[error("no map could be opened: {ct4}; {ct6}")]
    Unavailable {
        /// Why `ct4` could not be opened.
        ct4: Arc<MapError>,
        /// Why `ct6` could not be opened.
        ct6: Arc<MapError>,
    },
    /// The pass panicked (a bug, logged with the panic); the next pass
    /// starts afresh.
    #[error("pass {pass} panicked")]
    Panicked {
        /// The pass.
        pass: u64,
    },
}

/// A map handle of a pass.
pub type MapHandle<K, V> = Box<dyn EntryMap<Key = K, Value = V>>;
/// A conntrack map handle.
pub type CtMap<K> = MapHandle<K, CtEntry>;
/// Opens (again) a map.
pub type Opener<K, V = CtEntry> = Box<dyn FnMut() -> Result<MapHandle<K, V>, MapError> + Send>;

/// One map of the node: opened on first use, reopened when its pin names
/// another map (a loader that recreated it) or after an error.
pub struct Slot<K, V = CtEntry> {
    name: String,
    opener: Opener<K, V>,
    map: Option<MapHandle<K, V>>,
}

impl<K, V> std::fmt::Debug for Slot<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("name", &self.name)
            .field("open", &self.map.is_some())
            .finish_non_exhaustive()
    }
}

impl<K: aya::Pod + PartialEq + Send + 'static, V: aya::Pod + PartialEq + Send + 'static> Slot<K, V> {
    /// A slot that opens its map with `opener`.
    pub fn new(name: &str, opener: Opener<K, V>) -> Self {
        Self {
            name: name.to_owned(),
            opener,
            map: None,
        }
    }

    /// The slot of the datapath's map `def` pinned in `pin_dir`.
    pub fn pinned(pin_dir: &std::path::Path, def: &'static MapDef, mode: BatchMode) -> Self {
        let dir = pin_dir.to_owned();
        Self::new(
            def.name,
            Box::new(move || PinnedMap::<K, V>::open(&dir, def, mode).map(|m| Box::new(m) as MapHandle<K, V>)),
        )
    }

    /// The pin name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The open map, opening or reopening it as needed.
    pub fn get(&mut self) -> Result<&mut MapHandle<K, V>, MapError> {
        if self.map.as_ref().is_some_and(|m| !m.is_current()) {
            tracing::info!(map = %self.name, "the pin now names another map (or is gone): reopening");
            self.map = None;
        }
        if self.map.is_none() {
            let map = (self.opener)()?;
            tracing::info!(map = %self.name, max_entries = map.max_entries(), "map opened");
            self.map = Some(map);
        }
        Ok(self.map.as_mut().expect("just opened"))
    }

    /// Forgets the handle (reopened on next use).
    pub fn close(&mut self) {
        self.map = None;
    }
}

/// The service maps a pass sweeps after conntrack: the translated flows
/// (expired past their deadline) and session affinity (unused past their
/// service's timeout, or of a service that is gone, judged by
/// `lb_frontends`, which is only read).
#[derive(Debug)]
pub struct ServiceSlots {
    /// IPv4 translated flows.
    pub lb4_flows: Slot<Ct4Key, LbFlow>,
    /// IPv6 translated flows.
    pub lb6_flows: Slot<Ct6Key, LbFlow>,
    /// Session affinity.
    pub lb_affinity: Slot<LbAffinityKey, LbAffinity>,
    /// The frontends (read for the services' affinity timeouts).
    pub lb_frontends: Slot<LbFrontendKey, LbFrontend>,
    /// Socket-level load balancing's translations (datagram entries).
    pub lb_sock_rev: Slot<LbSockRevKey, LbSockRev>,
    /// Where the pins are: a map not pinned there (a datapath without
    /// services) is left out of the pass instead of failing it.
    pub pin_dir: Option<std::path::PathBuf>,
}

impl ServiceSlots {
    /// The node's pinned service maps in `pin_dir`.
    pub fn pinned(pin_dir: &std::path::Path, mode: BatchMode) -> Self {
        Self {
            lb4_flows: Slot::pinned(pin_dir, &spec::LB4_FLOWS, mode),
            lb6_flows: Slot::pinned(pin_dir, &spec::LB6_FLOWS, mode),
            lb_affinity: Slot::pinned(pin_dir, &spec::LB_AFFINITY, mode),
            lb_frontends: Slot::pinned(pin_dir, &spec::LB_FRONTENDS, mode),
            lb_sock_rev: Slot::pinned(pin_dir, &spec::LB_SOCK_REV, mode),
            pin_dir: Some(pin_dir.to_owned()),
        }
    }

    fn present(&self, name: &str) -> bool {
        self.pin_dir.as_ref().is_none_or(|dir| dir.join(name).exists())
    }

    /// The estimated fill of the flow maps that are pinned (name, entries,
    /// max_entries), for the collector's map-pressure check.
    pub fn flow_fills(&mut self) -> Vec<(String, Result<u64, MapError>, u32)> {
        fn fill<K, V>(slot: &mut Slot<K, V>) -> Option<(String, Result<u64, MapError>, u32)>
        where
            K: aya::Pod + PartialEq + Send + 'static,
            V: aya::Pod + PartialEq + Send + 'static,
        {
            let m = slot.get().ok()?;
            Some((m.name().to_owned(), m.estimate_len(), m.max_entries()))
        }
        let mut out = Vec::new();
        if self.present(&self.lb4_flows.name) {
            out.extend(fill(&mut self.lb4_flows));
        }
        if self.present(&self.lb6_flows.name) {
            out.extend(fill(&mut self.lb6_flows));
        }
        out
    }

    /// Map names in sweep order (the frontends are read, not swept).
    pub fn names(&self) -> Vec<String> {
        [
            &self.lb4_flows.name,
            &self.lb6_flows.name,
            &self.lb_affinity.name,
            &self.lb_sock_rev.name,
        ]
        .into_iter()
        .cloned()
        .collect()
    }
}

/// The maps a pass sweeps.
#[derive(Debug)]
pub struct GcMaps {
    /// IPv4 conntrack.
    pub ct4: Slot<Ct4Key>,
    /// IPv6 conntrack.
    pub ct6: Slot<Ct6Key>,
    /// The service maps, if swept.
    pub services: Option<ServiceSlots>,
}

impl GcMaps {
    /// The node's pinned maps in `pin_dir` (`<bpffs>/rivet/<node>`).
    pub fn pinned(pin_dir: &std::path::Path, mode: BatchMode) -> Self {
        Self {
            ct4: Slot::pinned(pin_dir, &spec::CT4, mode),
            ct6: Slot::pinned(pin_dir, &spec::CT6, mode),
            services: Some(ServiceSlots::pinned(pin_dir, mode)),
        }
    }

    /// Map names in sweep order.
    pub fn names(&self) -> Vec<String> {
        let mut names = vec![self.ct4.name().to_owned(), self.ct6.name().to_owned()];
        names.extend(self.services.iter().flat_map(ServiceSlots::names));
        names
    }
}

/// Sweeps one conntrack map (see the module docs).
pub fn sweep_ct<K: CtKey>(
    map: &mut dyn EntryMap<Key = K, Value = CtEntry>,
    rules: &CtRules,
    clock: &dyn Clock,
) -> MapReport {
    sweep(map, |k, v, now| rules.verdict(k, v, now), clock)
}

/// Sweeps one map with `verdict` (see the module docs: the re-check of
/// every candidate before its batch delete is the same for every map).
pub fn sweep<K, V>(
    map: &mut dyn EntryMap<Key = K, Value = V>,
    verdict: impl Fn(&K, &V, u64) -> Option<Reason>,
    clock: &dyn Clock,
) -> MapReport
where
    K: aya::Pod + PartialEq + Send,
    V: aya::Pod + PartialEq + Send,
{
    let started = Instant::now();
    let mut report = MapReport {
        map: map.name().to_owned(),
        max_entries: map.max_entries(),
        ..MapReport::default()
    };
    let mut keys: Vec<K> = Vec::with_capacity(CHUNK);
    let mut values: Vec<V> = Vec::with_capacity(CHUNK);
    let mut candidates: Vec<(usize, Reason)> = Vec::new();
    let mut confirmed: Vec<K> = Vec::with_capacity(DELETE_GROUP);
    let mut reasons: Vec<Reason> = Vec::with_capacity(DELETE_GROUP);
    map.begin_scan();
    let result = (|| -> Result<(), MapError> {
        loop {
            let more = map.next_chunk(&mut keys, &mut values)?;
            report.scanned += keys.len() as u64;
            // Read after the chunk: every refresh the chunk shows is older.
            let now = clock.monotonic_nanos();
            candidates.clear();
            candidates.extend(
                keys.iter()
                    .zip(&values)
                    .enumerate()
                    .filter_map(|(i, (k, v))| verdict(k, v, now).map(|r| (i, r))),
            );
            for group in candidates.chunks(DELETE_GROUP) {
                confirmed.clear();
                reasons.clear();
                for &(i, reason) in group {
                    match map.lookup(&keys[i])? {
                        Some(current) if current == values[i] => {
                            confirmed.push(keys[i]);
                            reasons.push(reason);
                        }
                        Some(_) => report.spared_refreshed += 1,
                        None => report.vanished += 1,
                    }
                }
                let outcome = map.delete(&confirmed)?;
                let mut missing = outcome.missing.iter().copied().peekable();
                for (j, reason) in reasons.iter().enumerate() {
                    if missing.next_if_eq(&j).is_some() {
                        report.vanished += 1;
                    } else {
                        report.deleted.count(*reason);
                    }
                }
            }
            if !more {
                return Ok(());
            }
        }
    })();
    if let Err(e) = result {
        report.error = Some(e.to_string());
    }
    report.batched = map.batched();
    report.remaining = report
        .scanned
        .saturating_sub(report.deleted.total())
        .saturating_sub(report.vanished);
    report.duration = started.elapsed();
    report
}

/// What a pass needs besides the maps.
#[derive(Clone, Debug)]
pub struct PassPlan {
    /// Its number.
    pub number: u64,
    /// Why it runs.
    pub trigger: Trigger,
    /// What to delete.
    pub rules: CtRules,
    /// Whether `rules` carries endpoints, and if not why.
    pub orphan_check: OrphanCheck,
}

/// Sweeps one map; the error is why it could not be opened.
fn sweep_slot<K, V>(
    slot: &mut Slot<K, V>,
    verdict: impl Fn(&K, &V, u64) -> Option<Reason>,
    clock: &dyn Clock,
) -> (MapReport, Option<MapError>)
where
    K: aya::Pod + PartialEq + Send + 'static,
    V: aya::Pod + PartialEq + Send + 'static,
{
    match slot.get() {
        Ok(map) => {
            let report = sweep(map.as_mut(), verdict, clock);
            if report.error.is_some() {
                // Start from a fresh handle next time.
                slot.close();
            }
            (report, None)
        }
        Err(e) => (
            MapReport {
                map: slot.name().to_owned(),
                error: Some(e.to_string()),
                ..MapReport::default()
            },
            Some(e),
        ),
    }
}

/// Runs one pass over every map. Fails only when no map could be opened.
pub fn run_pass(maps: &mut GcMaps, plan: &PassPlan, clock: &dyn Clock) -> Result<PassReport, PassError> {
    let started = Instant::now();
    let started_unix_nanos = clock.unix_nanos();
    let started_monotonic = clock.monotonic_nanos();
    let rules = &plan.rules;
    let (ct4, closed4) = sweep_slot(&mut maps.ct4, |k, v, now| rules.verdict(k, v, now), clock);
    let (ct6, closed6) = sweep_slot(&mut maps.ct6, |k, v, now| rules.verdict(k, v, now), clock);
    if let (Some(ct4), Some(ct6)) = (closed4, closed6) {
        return Err(PassError::Unavailable {
            ct4: Arc::new(ct4),
            ct6: Arc::new(ct6),
        });
    }
    let mut reports = vec![ct4, ct6];
    if let Some(services) = &mut maps.services {
        reports.extend(sweep_services(services, &rules.timeouts, clock));
    }
    let scanned = reports.iter().map(|m| m.scanned).sum::<u64>();
    let mut deleted = DeletedCounts::default();
    for m in &reports {
        deleted.add(&m.deleted);
    }
    let delete_ratio = if scanned == 0 {
        0.0
    } else {
        deleted.total() as f64 / scanned as f64
    };
    Ok(PassReport {
        number: plan.number,
        trigger: plan.trigger,
        started_unix_nanos,
        started_monotonic,
        duration: started.elapsed(),
        maps: reports,
        scanned,
        deleted,
        delete_ratio,
        orphan_check: plan.orphan_check,
    })
}

/// Sweeps the service maps that are pinned: the flows, then affinity with
/// the services' timeouts read from `lb_frontends` first (affinity is not
/// swept when they cannot be read: a service's entries would look
/// orphaned), then the sockets' datagram translations (`timeouts.udp`).
fn sweep_services(slots: &mut ServiceSlots, timeouts: &Timeouts, clock: &dyn Clock) -> Vec<MapReport> {
    let mut reports = Vec::new();
    if slots.present(&slots.lb4_flows.name) {
        reports.push(sweep_slot(&mut slots.lb4_flows, |_, v, now| flow_verdict(v, now), clock).0);
    }
    if slots.present(&slots.lb6_flows.name) {
        reports.push(sweep_slot(&mut slots.lb6_flows, |_, v, now| flow_verdict(v, now), clock).0);
    }
    if slots.present(&slots.lb_affinity.name) {
        reports.push(sweep_affinity(slots, clock));
    }
    if slots.present(&slots.lb_sock_rev.name) {
        let udp = timeouts.udp;
        reports.push(sweep_slot(&mut slots.lb_sock_rev, |_, v, now| sock_rev_verdict(v, udp, now), clock).0);
    }
    reports
}

/// Sweeps `lb_affinity` with the services' timeouts read from
/// `lb_frontends` first.
fn sweep_affinity(slots: &mut ServiceSlots, clock: &dyn Clock) -> MapReport {
    let read_at = clock.monotonic_nanos();
    let rules = match read_all(&mut slots.lb_frontends) {
        Ok(frontends) => AffinityRules::from_frontends(&frontends, read_at),
        Err(e) => {
            slots.lb_frontends.close();
            return MapReport {
                map: slots.lb_affinity.name().to_owned(),
                error: Some(format!("not swept: reading the services' timeouts: {e}")),
                ..MapReport::default()
            };
        }
    };
    sweep_slot(&mut slots.lb_affinity, |k, v, now| rules.verdict(k, v, now), clock).0
}

/// Every value of a slot's map.
fn read_all<K, V>(slot: &mut Slot<K, V>) -> Result<Vec<V>, MapError>
where
    K: aya::Pod + PartialEq + Send + 'static,
    V: aya::Pod + PartialEq + Send + 'static,
{
    let map = slot.get()?;
    let (mut keys, mut values, mut all) = (Vec::new(), Vec::new(), Vec::new());
    map.begin_scan();
    loop {
        let more = map.next_chunk(&mut keys, &mut values)?;
        all.append(&mut values);
        if !more {
            return Ok(all);
        }
    }
}
