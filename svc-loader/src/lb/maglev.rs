//! Maglev consistent hashing (Eisenbud et al., NSDI 2016, §3.4): the
//! lookup table of a service, [`LB_MAGLEV_SIZE`] slots of backend ids.
//!
//! Every node computes the same table for the same backend set: the
//! preference list of a backend depends only on its (address, port), hashed
//! with SHA-256 (a fixed, specified function, not std's hasher, which may
//! change between Rust releases), and backends are placed in (address,
//! port) order, whatever order they were given in and whatever ids they
//! have. The datapath takes slot `hash(5-tuple) % LB_MAGLEV_SIZE`, so every
//! node sends a flow to the same backend, and a backend change moves about
//! 1/N of the slots (Maglev's minimal disruption: mostly the slots of the
//! backend that changed).

use std::net::SocketAddr;

use rivet_datapath::maps::{LB_MAGLEV_SIZE, LbMaglevTable};
use sha2::{Digest, Sha256};

const M: u64 = LB_MAGLEV_SIZE as u64;

/// A backend's place in the permutation: `offset`, `skip` (Maglev's two
/// hashes of its name).
fn permutation(backend: SocketAddr) -> (u64, u64) {
    let mut hasher = Sha256::new();
    hasher.update(b"rivet-maglev-v1");
    match backend {
        SocketAddr::V4(v4) => {
            hasher.update([4]);
            hasher.update(v4.ip().octets());
        }
        SocketAddr::V6(v6) => {
            hasher.update([6]);
            hasher.update(v6.ip().octets());
        }
    }
    hasher.update(backend.port().to_be_bytes());
    let digest = hasher.finalize();
    let word = |i: usize| u64::from_be_bytes(digest[i..i + 8].try_into().expect("8 bytes of a 32-byte digest"));
    (word(0) % M, word(8) % (M - 1) + 1)
}

/// The table for `backends` ((address, port) → backend id): each slot holds
/// one backend's id, each backend holds ⌊M/N⌋ or ⌈M/N⌉ slots. Empty
/// `backends` give an all-zero table (no backend). Duplicate addresses
/// keep one entry.
pub fn table(backends: &[(SocketAddr, u32)]) -> LbMaglevTable {
    let mut sorted: Vec<(SocketAddr, u32)> = backends.to_vec();
    sorted.sort_unstable();
    sorted.dedup_by_key(|(addr, _)| *addr);
    let mut table = LbMaglevTable::default();
    if sorted.is_empty() {
        return table;
    }
    let perms: Vec<(u64, u64)> = sorted.iter().map(|(addr, _)| permutation(*addr)).collect();
    let mut next = vec![0u64; sorted.len()];
    let mut filled = vec![false; LB_MAGLEV_SIZE];
    let mut placed = 0;
    // Backends take turns claiming their next preferred free slot.
    'fill: loop {
        for (i, (offset, skip)) in perms.iter().enumerate() {
            let mut slot = ((offset + next[i] * skip) % M) as usize;
            while filled[slot] {
                next[i] += 1;
                slot = ((offset + next[i] * skip) % M) as usize;
            }
            filled[slot] = true;
            table.backend_ids[slot] = sorted[i].1;
            next[i] += 1;
            placed += 1;
            if placed == LB_MAGLEV_SIZE {
                break 'fill;
            }
        }
    }
    table
}

/// Slots each backend id holds in `table` (ids absent from it hold none).
pub fn slot_counts(table: &LbMaglevTable) -> std::collections::BTreeMap<u32, u32> {
    let mut counts = std::collections::BTreeMap::new();
    for id in table.backend_ids.iter().filter(|id| **id != 0) {
        *counts.entry(*id).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use super::*;

    fn backend(i: u32) -> SocketAddr {
        SocketAddr::new(
            std::net::Ipv4Addr::new(198, 18, (i / 250) as u8, (i % 250 + 2) as u8).into(),
            8080,
        )
    }

    fn backends(ids: impl IntoIterator<Item = u32>) -> Vec<(SocketAddr, u32)> {
        ids.into_iter().map(|i| (backend(i), i)).collect()
    }

    /// Slot of the `i`-th synthetic flow: uniform like the datapath's
    /// 5-tuple hash.
    fn flow_slot(i: u32) -> usize {
        let digest = Sha256::digest(i.to_be_bytes());
        (u64::from_be_bytes(digest[..8].try_into().unwrap()) % M) as usize
    }

    #[test]
    fn three_backends_share_many_flows_within_ten_percent() {
        let table = table(&backends(1..=3));
        let counts = slot_counts(&table);
        assert_eq!(counts.len(), 3);
        for n in counts.values() {
            assert!(
                (340..=341).contains(n),
                "Maglev's slots are within one of even: {counts:?}"
            );
        }
        let flows = 30_000;
        let mut per_backend: BTreeMap<u32, u32> = BTreeMap::new();
        for i in 0..flows {
            *per_backend.entry(table.backend_ids[flow_slot(i)]).or_default() += 1;
        }
        let even = f64::from(flows) / 3.0;
        for (id, n) in &per_backend {
            let off = (f64::from(*n) - even).abs() / even;
            assert!(
                off <= 0.10,
                "backend {id}: {n} flows of {flows} ({:.1}% off even)",
                off * 100.0
            );
        }
    }

    #[test]
    fn the_table_depends_on_the_set_only_not_on_order_or_call() {
        let set = backends(1..=10);
        let mut reversed = set.clone();
        reversed.reverse();
        let mut shuffled = set.clone();
        shuffled.rotate_left(4);
        shuffled.swap(1, 7);
        let a = table(&set);
        assert_eq!(a, table(&reversed));
        assert_eq!(a, table(&shuffled));
        // Ids only label the slots: the same addresses with other ids
        // place every address on the same slots.
        let relabelled: Vec<(SocketAddr, u32)> = set.iter().map(|(addr, id)| (*addr, id + 100)).collect();
        let b = table(&relabelled);
        for slot in 0..LB_MAGLEV_SIZE {
            assert_eq!(b.backend_ids[slot], a.backend_ids[slot] + 100);
        }
        assert_eq!(table(&[]), LbMaglevTable::default());
    }

    /// Removing a backend moves its slots to the others; of the other
    /// backends' slots, Maglev moves only a few (the paper's "minimal
    /// disruption", not none): measured 3 of 680 (3 backends), 21 of 918
    /// (10), 32 of 1010 (100).
    #[test]
    fn removing_a_backend_keeps_the_other_backends_flows() {
        for n in [3u32, 10, 100] {
            let before = table(&backends(1..=n));
            let after = table(&backends(2..=n));
            let mut kept = 0;
            let mut moved = 0;
            for slot in 0..LB_MAGLEV_SIZE {
                if before.backend_ids[slot] == 1 {
                    assert_ne!(after.backend_ids[slot], 1);
                    continue;
                }
                if before.backend_ids[slot] == after.backend_ids[slot] {
                    kept += 1;
                } else {
                    moved += 1;
                }
            }
            let moved_share = f64::from(moved) / f64::from(kept + moved);
            println!(
                "{n} backends, one removed: {moved} of the others' {} slots moved",
                kept + moved
            );
            assert!(
                moved_share <= 0.05,
                "{n} backends: {moved} of {} surviving slots moved",
                kept + moved
            );
        }
    }

    #[test]
    fn adding_a_backend_moves_about_one_in_n_plus_one() {
        for n in [3u32, 10, 100] {
            let before = table(&backends(1..=n));
            let after = table(&backends(1..=n + 1));
            let moved = (0..LB_MAGLEV_SIZE)
                .filter(|slot| before.backend_ids[*slot] != after.backend_ids[*slot])
                .count();
            let to_new = (0..LB_MAGLEV_SIZE)
                .filter(|slot| after.backend_ids[*slot] == n + 1)
                .count();
            let expected = LB_MAGLEV_SIZE as f64 / f64::from(n + 1);
            println!("{n} backends + 1: {moved} slots moved, {to_new} to the new backend (1/(N+1) = {expected:.0})");
            assert!(to_new as f64 >= expected.floor() && to_new as f64 <= expected.ceil());
            // Besides the new backend's share, Maglev reshuffles a few slots
            // among the others: more as N nears M (M/N = 10 at N = 100).
            let collateral = moved - to_new;
            assert!(
                collateral <= LB_MAGLEV_SIZE / 20,
                "{n} + 1 backends: {collateral} slots moved between old backends"
            );
        }
    }

    #[test]
    fn a_table_of_100_backends_builds_fast() {
        let set = backends(1..=100);
        let start = Instant::now();
        let runs = 20;
        for _ in 0..runs {
            std::hint::black_box(table(std::hint::black_box(&set)));
        }
        let each = start.elapsed() / runs;
        println!("Maglev table of 100 backends, M = {LB_MAGLEV_SIZE}: {each:?} (debug build)");
        let counts = slot_counts(&table(&set));
        assert_eq!(counts.len(), 100);
        assert!(counts.values().all(|n| (10..=11).contains(n)), "{counts:?}");
    }
}
