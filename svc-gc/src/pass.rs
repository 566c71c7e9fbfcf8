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
//! # Where a NAT map slots in
//!
//! The datapath has no NAT map yet, so a pass sweeps `ct4` and `ct6` only and
//! `nat_without_connection` stays 0. A NAT map becomes another [`Slot`] in
//! [`GcMaps`] with its own key and value types, swept after the conntrack
//! maps by a `sweep` whose verdict looks the entry's connection up in `ct4` /
//! `ct6` ([`Reason::NatWithoutConnection`]); the re-check and batch delete
//! are the same.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rivet_datapath::maps::{Ct4Key, Ct6Key, CtEntry};
use rivet_datapath::spec::{self, MapDef};

use crate::classify::{CtKey, CtRules, Reason};
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
}

impl DeletedCounts {
    /// All reasons together.
    pub fn total(&self) -> u64 {
        self.expired + self.orphaned_endpoint + self.nat_without_connection
    }

    /// Counts one more for `reason`.
    pub fn count(&mut self, reason: Reason) {
        match reason {
            Reason::Expired => self.expired += 1,
            Reason::OrphanedEndpoint => self.orphaned_endpoint += 1,
            Reason::NatWithoutConnection => self.nat_without_connection += 1,
        }
    }

    /// Adds `other`.
    pub fn add(&mut self, other: &Self) {
        self.expired += other.expired;
        self.orphaned_endpoint += other.orphaned_endpoint;
        self.nat_without_connection += other.nat_without_connection;
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

/// A conntrack map handle.
pub type CtMap<K> = Box<dyn EntryMap<Key = K, Value = CtEntry>>;
/// Opens (again) a conntrack map.
pub type Opener<K> = Box<dyn FnMut() -> Result<CtMap<K>, MapError> + Send>;

/// One map of the node: opened on first use, reopened when its pin names
/// another map (a loader that recreated it) or after an error.
pub struct Slot<K> {
    name: String,
    opener: Opener<K>,
    map: Option<CtMap<K>>,
}

impl<K> std::fmt::Debug for Slot<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("name", &self.name)
            .field("open", &self.map.is_some())
            .finish_non_exhaustive()
    }
}

impl<K: CtKey + 'static> Slot<K> {
    /// A slot that opens its map with `opener`.
    pub fn new(name: &str, opener: Opener<K>) -> Self {
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
            Box::new(move || PinnedMap::<K, CtEntry>::open(&dir, def, mode).map(|m| Box::new(m) as CtMap<K>)),
        )
    }

    /// The pin name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The open map, opening or reopening it as needed.
    pub fn get(&mut self) -> Result<&mut CtMap<K>, MapError> {
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

/// The maps a pass sweeps.
#[derive(Debug)]
pub struct GcMaps {
    /// IPv4 conntrack.
    pub ct4: Slot<Ct4Key>,
    /// IPv6 conntrack.
    pub ct6: Slot<Ct6Key>,
}

impl GcMaps {
    /// The node's pinned maps in `pin_dir` (`<bpffs>/rivet/<node>`).
    pub fn pinned(pin_dir: &std::path::Path, mode: BatchMode) -> Self {
        Self {
            ct4: Slot::pinned(pin_dir, &spec::CT4, mode),
            ct6: Slot::pinned(pin_dir, &spec::CT6, mode),
        }
    }

    /// Map names in sweep order.
    pub fn names(&self) -> Vec<String> {
        vec![self.ct4.name().to_owned(), self.ct6.name().to_owned()]
    }
}

/// Sweeps one conntrack map (see the module docs).
pub fn sweep_ct<K: CtKey>(
    map: &mut dyn EntryMap<Key = K, Value = CtEntry>,
    rules: &CtRules,
    clock: &dyn Clock,
) -> MapReport {
    let started = Instant::now();
    let mut report = MapReport {
        map: map.name().to_owned(),
        max_entries: map.max_entries(),
        ..MapReport::default()
    };
    let mut keys: Vec<K> = Vec::with_capacity(CHUNK);
    let mut values: Vec<CtEntry> = Vec::with_capacity(CHUNK);
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
                    .filter_map(|(i, (k, v))| rules.verdict(k, v, now).map(|r| (i, r))),
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
fn sweep_slot<K: CtKey + 'static>(
    slot: &mut Slot<K>,
    rules: &CtRules,
    clock: &dyn Clock,
) -> (MapReport, Option<MapError>) {
    match slot.get() {
        Ok(map) => {
            let report = sweep_ct(map.as_mut(), rules, clock);
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
    let (ct4, closed4) = sweep_slot(&mut maps.ct4, &plan.rules, clock);
    let (ct6, closed6) = sweep_slot(&mut maps.ct6, &plan.rules, clock);
    if let (Some(ct4), Some(ct6)) = (closed4, closed6) {
        return Err(PassError::Unavailable {
            ct4: Arc::new(ct4),
            ct6: Arc::new(ct6),
        });
    }
    let reports = vec![ct4, ct6];
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
