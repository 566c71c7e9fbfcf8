//! The two-round rule, with no I/O: an identity is deleted only when two
//! consecutive rounds saw it unused AT THE SAME VERSION (etcd: the master
//! key's mod revision; the CRD store: the object's resourceVersion). Any
//! write in between (a reuse) changes the version and restarts its count.

use std::collections::HashMap;

/// One identity as a round's scan saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen<V> {
    /// The identity number.
    pub id: u32,
    /// Its version (mod revision, resourceVersion).
    pub version: V,
    /// Whether anything uses it now (a value key, a RivetEndpoint).
    pub used: bool,
}

/// Why a remembered candidate is not deleted this round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// Still unused, but written since the last round (reused and released
    /// in between): it starts over.
    Reused,
    /// In use again.
    InUse,
    /// Deleted by someone else meanwhile.
    Gone,
    /// The delete's fence failed: changed between this round's scan and its
    /// delete (a race with an allocation).
    Changed,
}

impl SkipReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reused => "reused",
            Self::InUse => "in_use",
            Self::Gone => "gone",
            Self::Changed => "changed",
        }
    }
}

/// What one round does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan<V> {
    /// Unused for two rounds at this version: delete, fenced on it.
    pub delete: Vec<(u32, V)>,
    /// Unused now but not at this version last round: remember (the
    /// caller calls [`Candidates::remember`], with the version after any
    /// marking write of its own).
    pub first_seen: Vec<(u32, V)>,
    /// Used now: nothing to do (the CRD store removes a mark it finds).
    pub used: Vec<(u32, V)>,
    /// Remembered candidates that are not deleted, and why.
    pub skipped: Vec<(u32, SkipReason)>,
}

/// The candidates remembered from the last round.
///
/// ```
/// use rivet_operator::identity_gc::rounds::{Candidates, Seen};
/// let mut candidates = Candidates::default();
/// let unused = |version| vec![Seen { id: 300, version, used: false }];
/// let first = candidates.round(unused(7));
/// assert!(first.delete.is_empty(), "one round is not enough");
/// candidates.remember(300, 7);
/// assert_eq!(candidates.round(unused(7)).delete, [(300, 7)]);
/// ```
#[derive(Debug, Clone)]
pub struct Candidates<V> {
    remembered: HashMap<u32, V>,
}

impl<V> Default for Candidates<V> {
    fn default() -> Self {
        Self {
            remembered: HashMap::new(),
        }
    }
}

impl<V: Clone + PartialEq> Candidates<V> {
    /// Plans a round over everything the scan saw and forgets the last
    /// round's candidates: the caller [`remember`](Self::remember)s the
    /// new ones.
    pub fn round(&mut self, scan: impl IntoIterator<Item = Seen<V>>) -> Plan<V> {
        let mut previous = std::mem::take(&mut self.remembered);
        let mut plan = Plan {
            delete: Vec::new(),
            first_seen: Vec::new(),
            used: Vec::new(),
            skipped: Vec::new(),
        };
        for Seen { id, version, used } in scan {
            let before = previous.remove(&id);
            if used {
                if before.is_some() {
                    plan.skipped.push((id, SkipReason::InUse));
                }
                plan.used.push((id, version));
                continue;
            }
            match before {
                Some(before) if before == version => plan.delete.push((id, version)),
                Some(_) => {
                    plan.skipped.push((id, SkipReason::Reused));
                    plan.first_seen.push((id, version));
                }
                None => plan.first_seen.push((id, version)),
            }
        }
        plan.skipped
            .extend(previous.into_keys().map(|id| (id, SkipReason::Gone)));
        plan
    }

    /// Remembers `id` as unused at `version` for the next round.
    pub fn remember(&mut self, id: u32, version: V) {
        self.remembered.insert(id, version);
    }

    /// How many candidates are remembered.
    pub fn len(&self) -> usize {
        self.remembered.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.remembered.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(id: u32, version: i64, used: bool) -> Seen<i64> {
        Seen { id, version, used }
    }

    /// A simulation against an oracle: identities get used, released and
    /// reused at random between rounds; an identity is deleted exactly when
    /// it was unused and unwritten over two consecutive scans.
    #[test]
    fn deletes_exactly_what_two_consecutive_scans_saw_unused_at_one_version() {
        // A small deterministic generator (no rand in the pure core's test).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let mut store: HashMap<u32, (i64, bool)> = (256..356).map(|id| (id, (1, false))).collect();
        let mut revision = 1;
        let mut candidates = Candidates::default();
        let mut last_scan: HashMap<u32, (i64, bool)> = HashMap::new();
        for _round in 0..200 {
            // Random changes between rounds.
            for _ in 0..next(20) {
                let id = 256 + u32::try_from(next(110)).unwrap();
                revision += 1;
                match next(3) {
                    0 => {
                        store.insert(id, (revision, true)); // used (or re-created)
                    }
                    1 => {
                        if let Some(e) = store.get_mut(&id) {
                            e.1 = false; // released: the version stays
                        }
                    }
                    _ => {
                        if let Some(e) = store.get_mut(&id) {
                            *e = (revision, false); // reused and released
                        }
                    }
                }
            }
            let scan: HashMap<u32, (i64, bool)> = store.clone();
            let plan = candidates.round(scan.iter().map(|(&id, &(version, used))| seen(id, version, used)));
            let mut expected: Vec<(u32, i64)> = scan
                .iter()
                .filter(|(id, (version, used))| !used && last_scan.get(id) == Some(&(*version, false)))
                .map(|(&id, &(version, _))| (id, version))
                .collect();
            let mut deleted = plan.delete.clone();
            deleted.sort_unstable();
            expected.sort_unstable();
            assert_eq!(deleted, expected);
            for (id, _) in &plan.delete {
                store.remove(id);
            }
            for (id, version) in plan.first_seen {
                candidates.remember(id, version);
            }
            last_scan = store.clone();
        }
    }

    #[test]
    fn skipped_candidates_say_why() {
        let mut candidates = Candidates::default();
        for id in [300, 301, 302, 303] {
            candidates.remember(id, 5);
        }
        let plan = candidates.round([seen(300, 5, false), seen(301, 9, false), seen(302, 5, true)]);
        assert_eq!(plan.delete, [(300, 5)]);
        assert_eq!(plan.first_seen, [(301, 9)]);
        assert_eq!(plan.used, [(302, 5)]);
        assert_eq!(
            plan.skipped,
            [
                (301, SkipReason::Reused),
                (302, SkipReason::InUse),
                (303, SkipReason::Gone)
            ]
        );
        assert!(candidates.is_empty(), "a round forgets; the caller remembers");
    }
}
