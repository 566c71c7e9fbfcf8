//! Policy rules → entries of the policy LPM trie (pure; no BPF here).
//!
//! # How the datapath decides
//!
//! For a packet of endpoint `E` in direction `D` with peer identity `P`,
//! protocol `T` and destination port `p`, the datapath does a longest-prefix
//! lookup of the full key `(E, i, D, t, p)` for each identity `i ∈ {P, any}`
//! and protocol `t ∈ {T, any}` (four lookups). When `E` has prefixes in `D`
//! (ipBlock peers, matched by address) and the peer address's longest one
//! has CIDR identity `C`, it also looks up `(E, C, D | POLICY_DIR_BY_ADDRESS,
//! t, p)` for both `t` (two more lookups, in the address key space: a rule
//! with `by_address` compiles there), and
//!
//! - denies if any lookup returns `VERDICT_DENY`,
//! - else allows if any returns `VERDICT_ALLOW`,
//! - else has no verdict (allow if the endpoint does not enforce policy in
//!   that direction, default deny otherwise).
//!
//! A key's first `POLICY_PREFIX_FIXED_BITS` bits (endpoint, identity,
//! direction, protocol) are always matched whole; the remaining 16 bits are
//! the port in network byte order, i.e. most significant bit first, exactly
//! the order in which an LPM trie compares bits. So a block of `2^k` ports
//! aligned on `2^k` is one entry with `16 - k` port bits, a port range is the
//! minimal set of such blocks, "any port" is an entry with no port bit, and a
//! rule for any protocol (protocol 0) always means any port.
//!
//! # Deny wins, also within one lookup
//!
//! Within one `(identity, protocol)` space a longest-prefix lookup returns
//! only the *narrowest* block containing the port, so an ALLOW for port 80
//! would hide a DENY for ports 0-1023. [`compile`] therefore turns every entry
//! that lies inside a DENY block of the same space into a DENY. Entries that
//! merely repeat the verdict of the nearest enclosing entry are dropped (the
//! lookup finds the enclosing one, with the same verdict), so the result is
//! small and has one canonical form for a given meaning of the rules.
//!
//! The result of [`compile`] makes the datapath decide, for every packet,
//! exactly what the rules say: deny if any matching rule denies, allow if any
//! matching rule allows, nothing otherwise. The property test at the end of
//! this file checks that by simulating the byte-wise LPM lookups.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;

use aya::maps::lpm_trie::Key as LpmKey;

use rivet_datapath::maps::{
    DIR_EGRESS, DIR_INGRESS, POLICY_DIR_BY_ADDRESS, POLICY_PREFIX_FIXED_BITS, PolicyKey, PolicyKeyData, VERDICT_ALLOW,
    VERDICT_DENY,
};

/// One policy rule of one endpoint, as the control plane computed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PolicyRule {
    /// `DIR_INGRESS` or `DIR_EGRESS`.
    pub direction: u8,
    /// Matched by the peer's address: `peer_identity` is the CIDR identity
    /// of the peer address's longest prefix among the endpoint's (never 0).
    pub by_address: bool,
    /// Peer identity; `IDENTITY_ANY` (0) = any peer.
    pub peer_identity: u32,
    /// `IPPROTO_*`; 0 = any protocol (and then any port).
    pub protocol: u8,
    /// First destination port; 0 = any port.
    pub port: u16,
    /// Last destination port of a range (NetworkPolicy `endPort`); 0 = just `port`.
    pub end_port: u16,
    /// `VERDICT_ALLOW` or `VERDICT_DENY`.
    pub verdict: u8,
}

impl PolicyRule {
    /// The ports this rule covers (`0..=65535` for any port).
    pub fn ports(&self) -> RangeInclusive<u16> {
        match (self.protocol, self.port, self.end_port) {
            (0, _, _) | (_, 0, _) => 0..=u16::MAX,
            (_, port, 0) => port..=port,
            (_, port, end) => port..=end,
        }
    }

    /// Whether the rule applies to a packet: its peer's identity, the CIDR
    /// identity of its peer address's longest prefix among the endpoint's
    /// (if any), protocol and port. Only meaningful for a rule that
    /// [`compile`] accepts.
    pub fn matches(
        &self,
        direction: u8,
        peer_identity: u32,
        address_identity: Option<u32>,
        protocol: u8,
        port: u16,
    ) -> bool {
        let peer = if self.by_address {
            address_identity == Some(self.peer_identity)
        } else {
            self.peer_identity == 0 || self.peer_identity == peer_identity
        };
        self.direction == direction
            && peer
            && (self.protocol == 0 || self.protocol == protocol)
            && self.ports().contains(&port)
    }
}

/// A rule [`compile`] refuses; nothing is compiled then.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyRuleError {
    /// Direction other than `DIR_INGRESS` / `DIR_EGRESS`.
    #[error("rule {index}: direction {direction} is neither ingress (1) nor egress (2)")]
    Direction {
        /// Position of the rule in the input.
        index: usize,
        /// The direction given.
        direction: u8,
    },
    /// Verdict other than `VERDICT_ALLOW` / `VERDICT_DENY`.
    #[error("rule {index}: verdict {verdict} is neither allow (1) nor deny (2)")]
    Verdict {
        /// Position of the rule in the input.
        index: usize,
        /// The verdict given.
        verdict: u8,
    },
    /// A port with protocol 0 ("any"): the key cannot express it, and
    /// widening it to every port of every protocol would allow far more than
    /// asked. Send one rule per protocol (Kubernetes: TCP when unspecified).
    #[error(
        "rule {index}: port {port} needs a protocol; protocol 0 means any protocol and any port \
         (send one rule per protocol instead)"
    )]
    PortWithoutProtocol {
        /// Position of the rule in the input.
        index: usize,
        /// The port given.
        port: u16,
    },
    /// An address-matched rule without a CIDR identity.
    #[error("rule {index}: an address-matched rule names the CIDR identity of a prefix, not 0 (any)")]
    AddressWithoutPrefix {
        /// Position of the rule in the input.
        index: usize,
    },
    /// `end_port` without `port`, or smaller than `port`.
    #[error("rule {index}: port range {port}-{end_port} is empty or has no start port")]
    PortRange {
        /// Position of the rule in the input.
        index: usize,
        /// First port.
        port: u16,
        /// Last port.
        end_port: u16,
    },
}

/// One entry of the policy trie: the ports `port .. port + 2^(16 - port_bits)`
/// of one `(endpoint, direction, key space, identity, protocol)`.
///
/// Ordered by endpoint, direction, key space (identity before address),
/// identity, protocol, then port block (wider blocks before the narrower
/// ones they contain).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyEntry {
    /// The endpoint.
    pub endpoint_id: u32,
    /// `DIR_*`.
    pub direction: u8,
    /// In the address key space (`direction | POLICY_DIR_BY_ADDRESS` in the
    /// map key): `identity` is a CIDR identity of the endpoint's prefixes.
    pub by_address: bool,
    /// Peer identity, 0 = any.
    pub identity: u32,
    /// `IPPROTO_*`, 0 = any (then `port_bits` is 0).
    pub protocol: u8,
    /// First port of the block (host order; the bits beyond `port_bits` are 0).
    pub port: u16,
    /// Leading port bits matched: 0 = any port … 16 = exactly `port`.
    pub port_bits: u8,
}

impl PolicyEntry {
    /// The LPM prefix length of the entry.
    pub fn prefix_len(&self) -> u32 {
        POLICY_PREFIX_FIXED_BITS + u32::from(self.port_bits)
    }

    /// The ports the entry covers.
    pub fn ports(&self) -> RangeInclusive<u16> {
        let span = block_span(self.port_bits);
        self.port..=(u32::from(self.port) + span - 1) as u16
    }

    /// The whole C key (`struct policy_key`).
    pub fn key(&self) -> PolicyKey {
        let direction = if self.by_address {
            self.direction | POLICY_DIR_BY_ADDRESS
        } else {
            self.direction
        };
        PolicyKey::new(
            self.endpoint_id,
            self.identity,
            direction,
            self.protocol,
            self.port,
            self.port_bits,
        )
    }

    /// The key for aya's `LpmTrie<_, PolicyKeyData, PolicyValue>`.
    pub fn lpm_key(&self) -> LpmKey<PolicyKeyData> {
        self.key().to_lpm()
    }

    /// Back from a key read from the map; `None` for a key this module never
    /// writes (prefix length out of range, port bits beyond the prefix set).
    pub fn from_key(key: &PolicyKey) -> Option<Self> {
        let port_bits = key.port_bits()?;
        let entry = Self {
            endpoint_id: key.data.endpoint_id,
            direction: key.data.direction & !POLICY_DIR_BY_ADDRESS,
            by_address: key.data.direction & POLICY_DIR_BY_ADDRESS != 0,
            identity: key.data.identity,
            protocol: key.data.protocol,
            port: key.port(),
            port_bits,
        };
        (entry.key() == *key).then_some(entry)
    }

    /// Back from an aya LPM key; see [`from_key`](Self::from_key).
    pub fn from_lpm_key(key: &LpmKey<PolicyKeyData>) -> Option<Self> {
        Self::from_key(&PolicyKey::from_lpm(key))
    }

    /// Whether `other` lies inside this entry's port block, in the same space.
    pub fn contains(&self, other: &Self) -> bool {
        self.space() == other.space()
            && self.port_bits <= other.port_bits
            && other.port & port_mask(self.port_bits) == self.port
    }

    fn space(&self) -> (u32, u8, bool, u32, u8) {
        (
            self.endpoint_id,
            self.direction,
            self.by_address,
            self.identity,
            self.protocol,
        )
    }

    /// The entry of the block of `port_bits` bits containing this entry.
    fn ancestor(&self, port_bits: u8) -> Self {
        Self {
            port: self.port & port_mask(port_bits),
            port_bits,
            ..*self
        }
    }
}

fn block_span(port_bits: u8) -> u32 {
    1u32 << (16 - u32::from(port_bits.min(16)))
}

fn port_mask(port_bits: u8) -> u16 {
    u16::MAX.checked_shl(16 - u32::from(port_bits.min(16))).unwrap_or(0)
}

/// The minimal set of aligned power-of-two blocks covering `start..=end`, as
/// `(first port, port bits)`. Empty if `start > end`.
pub fn port_blocks(start: u16, end: u16) -> Vec<(u16, u8)> {
    let mut blocks = Vec::new();
    let (mut start, end) = (u32::from(start), u32::from(end));
    while start <= end {
        // The largest block aligned at `start` that does not pass `end`.
        let mut size_log = if start == 0 { 16 } else { start.trailing_zeros().min(16) };
        while start + (1 << size_log) - 1 > end {
            size_log -= 1;
        }
        blocks.push((start as u16, (16 - size_log) as u8));
        start += 1 << size_log;
    }
    blocks
}

/// Compiles the rules of one endpoint into the policy trie's entries and
/// their verdicts (see the module docs for the semantics).
///
/// An empty result means "no policy": with enforcement on, everything in
/// that direction is default-denied.
pub fn compile(endpoint_id: u32, rules: &[PolicyRule]) -> Result<BTreeMap<PolicyEntry, u8>, PolicyRuleError> {
    // 1. Every rule as its blocks; the same block twice merges, deny wins.
    let mut raw: BTreeMap<PolicyEntry, u8> = BTreeMap::new();
    for (index, rule) in rules.iter().enumerate() {
        validate(index, rule)?;
        let blocks = if rule.protocol == 0 || rule.port == 0 {
            vec![(0, 0)]
        } else {
            let end = if rule.end_port == 0 { rule.port } else { rule.end_port };
            port_blocks(rule.port, end)
        };
        for (port, port_bits) in blocks {
            let entry = PolicyEntry {
                endpoint_id,
                direction: rule.direction,
                by_address: rule.by_address,
                identity: rule.peer_identity,
                protocol: rule.protocol,
                port,
                port_bits,
            };
            let verdict = raw.entry(entry).or_insert(rule.verdict);
            if rule.verdict == VERDICT_DENY {
                *verdict = VERDICT_DENY;
            }
        }
    }

    // 2. Inside a DENY block everything is DENY (longest match must not let
    //    a narrow ALLOW hide a wider DENY).
    let denies: BTreeSet<PolicyEntry> = raw
        .iter()
        .filter(|(_, v)| **v == VERDICT_DENY)
        .map(|(e, _)| *e)
        .collect();
    for (entry, verdict) in raw.iter_mut() {
        if *verdict == VERDICT_ALLOW && (0..entry.port_bits).any(|bits| denies.contains(&entry.ancestor(bits))) {
            *verdict = VERDICT_DENY;
        }
    }

    // 3. Drop entries that repeat the verdict of their nearest enclosing
    //    entry: the lookup then finds that one, with the same verdict.
    let flattened = raw.clone();
    raw.retain(|entry, verdict| {
        let nearest = (0..entry.port_bits)
            .rev()
            .find_map(|bits| flattened.get(&entry.ancestor(bits)));
        nearest != Some(verdict)
    });
    Ok(raw)
}

fn validate(index: usize, rule: &PolicyRule) -> Result<(), PolicyRuleError> {
    if rule.direction != DIR_INGRESS && rule.direction != DIR_EGRESS {
        return Err(PolicyRuleError::Direction {
            index,
            direction: rule.direction,
        });
    }
    if rule.verdict != VERDICT_ALLOW && rule.verdict != VERDICT_DENY {
        return Err(PolicyRuleError::Verdict {
            index,
            verdict: rule.verdict,
        });
    }
    if rule.by_address && rule.peer_identity == 0 {
        return Err(PolicyRuleError::AddressWithoutPrefix { index });
    }
    if rule.protocol == 0 && (rule.port != 0 || rule.end_port != 0) {
        return Err(PolicyRuleError::PortWithoutProtocol { index, port: rule.port });
    }
    if rule.end_port != 0 && (rule.port == 0 || rule.end_port < rule.port) {
        return Err(PolicyRuleError::PortRange {
            index,
            port: rule.port,
            end_port: rule.end_port,
        });
    }
    Ok(())
}

/// One write of a [`PolicyDiff`]: `Some(verdict)` = insert or overwrite,
/// `None` = delete.
pub type PolicyStep = (PolicyEntry, Option<u8>);

/// What to write to move the map from `current` to `desired` entries, in an
/// order that never opens more than either policy allows: first add or
/// tighten to DENY, then remove stale ALLOWs, then add or loosen to ALLOW,
/// then remove stale DENYs. Entries whose verdict is unchanged are left
/// alone (their counters keep counting).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyDiff {
    /// Steps in order.
    pub steps: Vec<PolicyStep>,
    /// How many of the first steps only narrow what is allowed (add or
    /// tighten to DENY, remove stale ALLOWs); the rest loosen. Whatever else
    /// changes with the policy (the endpoint's prefixes) goes in between.
    pub tightening: usize,
}

impl PolicyDiff {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The steps that only narrow, then the steps that loosen.
    pub fn phases(&self) -> (&[PolicyStep], &[PolicyStep]) {
        self.steps.split_at(self.tightening)
    }
}

/// Computes the [`PolicyDiff`] from `current` (as read from the map) to `desired`.
pub fn diff(current: &BTreeMap<PolicyEntry, u8>, desired: &BTreeMap<PolicyEntry, u8>) -> PolicyDiff {
    let mut steps = Vec::new();
    let upserts = |verdict: u8| {
        desired
            .iter()
            .filter(move |(e, v)| **v == verdict && current.get(e) != Some(v))
            .map(|(e, v)| (*e, Some(*v)))
    };
    let removals = |verdict: u8| {
        current
            .iter()
            .filter(move |(e, v)| **v == verdict && !desired.contains_key(e))
            .map(|(e, _)| (*e, None))
    };
    steps.extend(upserts(VERDICT_DENY));
    steps.extend(
        current
            .iter()
            .filter(|(e, v)| **v != VERDICT_DENY && !desired.contains_key(e))
            .map(|(e, _)| (*e, None)),
    );
    let tightening = steps.len();
    steps.extend(upserts(VERDICT_ALLOW));
    steps.extend(removals(VERDICT_DENY));
    PolicyDiff { steps, tightening }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rivet_datapath::maps::{POLICY_PREFIX_FULL_BITS, PolicyKey};

    const TCP: u8 = 6;
    const UDP: u8 = 17;

    /// A rule matching peers by identity (the loader's tests build theirs with it too).
    pub(crate) fn rule(direction: u8, peer: u32, protocol: u8, port: u16, end_port: u16, verdict: u8) -> PolicyRule {
        PolicyRule {
            direction,
            by_address: false,
            peer_identity: peer,
            protocol,
            port,
            end_port,
            verdict,
        }
    }

    #[test]
    fn port_blocks_are_minimal_and_exact() {
        assert_eq!(port_blocks(80, 80), vec![(80, 16)]);
        assert_eq!(port_blocks(0, u16::MAX), vec![(0, 0)]);
        assert_eq!(port_blocks(1, u16::MAX).len(), 16);
        assert_eq!(port_blocks(1024, 2047), vec![(1024, 6)]);
        assert_eq!(port_blocks(8080, 8083), vec![(8080, 14)]);
        assert_eq!(port_blocks(79, 81), vec![(79, 16), (80, 15)]);
        assert_eq!(port_blocks(u16::MAX, u16::MAX), vec![(u16::MAX, 16)]);
        assert!(port_blocks(10, 9).is_empty());
        // Exhaustive on a sample of ranges: exact cover, aligned, disjoint,
        // and minimal (no two adjacent blocks could merge into one).
        let mut rng = Rng(0x5eed);
        for _ in 0..20_000 {
            let a = rng.port();
            let b = if rng.below(4) == 0 {
                a.saturating_add(rng.below(40) as u16)
            } else {
                rng.port()
            };
            let (start, end) = (a.min(b), a.max(b));
            let blocks = port_blocks(start, end);
            let mut next = u32::from(start);
            for (i, &(port, bits)) in blocks.iter().enumerate() {
                let span = block_span(bits);
                assert_eq!(u32::from(port), next, "{start}-{end}: gap or overlap");
                assert_eq!(
                    u32::from(port) % span,
                    0,
                    "{start}-{end}: block {port}/{bits} not aligned"
                );
                next += span;
                if let Some(&(p2, b2)) = blocks.get(i + 1)
                    && b2 == bits
                    && u32::from(port) % (span * 2) == 0
                {
                    panic!("{start}-{end}: {port}/{bits} and {p2}/{b2} could be one block");
                }
            }
            assert_eq!(next, u32::from(end) + 1, "{start}-{end}: not covered to the end");
            assert!(blocks.len() <= 30, "{start}-{end}: {} blocks", blocks.len());
        }
    }

    #[test]
    fn single_port_and_any_port() {
        let entries = compile(
            7,
            &[
                rule(DIR_INGRESS, 300, TCP, 80, 0, VERDICT_ALLOW),
                rule(DIR_EGRESS, 0, 0, 0, 0, VERDICT_ALLOW),
            ],
        )
        .unwrap();
        let keys: Vec<PolicyKey> = entries.keys().map(PolicyEntry::key).collect();
        assert_eq!(keys.len(), 2);
        assert!(keys.contains(&PolicyKey::new(7, 300, DIR_INGRESS, TCP, 80, 16)));
        assert!(keys.contains(&PolicyKey::new(7, 0, DIR_EGRESS, 0, 0, 0)));
        assert_eq!(keys.iter().map(|k| k.prefixlen).max(), Some(POLICY_PREFIX_FULL_BITS));
        assert!(entries.values().all(|v| *v == VERDICT_ALLOW));
    }

    #[test]
    fn a_narrow_allow_inside_a_deny_becomes_deny() {
        let entries = compile(
            1,
            &[
                rule(DIR_INGRESS, 5, TCP, 0, 0, VERDICT_DENY),
                rule(DIR_INGRESS, 5, TCP, 80, 0, VERDICT_ALLOW),
            ],
        )
        .unwrap();
        // The allow for 80 is inside the deny of every port: it is dropped
        // (same verdict as its enclosing entry after flattening).
        assert_eq!(entries.len(), 1);
        let (entry, verdict) = entries.iter().next().unwrap();
        assert_eq!((entry.port_bits, *verdict), (0, VERDICT_DENY));

        // A narrow deny inside a wide allow stays (longest match finds it).
        let entries = compile(
            1,
            &[
                rule(DIR_INGRESS, 5, TCP, 1000, 1999, VERDICT_ALLOW),
                rule(DIR_INGRESS, 5, TCP, 1024, 0, VERDICT_DENY),
            ],
        )
        .unwrap();
        assert!(
            entries
                .iter()
                .any(|(e, v)| e.port == 1024 && e.port_bits == 16 && *v == VERDICT_DENY)
        );
    }

    #[test]
    fn duplicates_merge_and_deny_wins() {
        let entries = compile(
            1,
            &[
                rule(DIR_EGRESS, 9, UDP, 53, 0, VERDICT_ALLOW),
                rule(DIR_EGRESS, 9, UDP, 53, 0, VERDICT_DENY),
                rule(DIR_EGRESS, 9, UDP, 53, 0, VERDICT_ALLOW),
            ],
        )
        .unwrap();
        assert_eq!(entries.values().collect::<Vec<_>>(), vec![&VERDICT_DENY]);
    }

    #[test]
    fn invalid_rules_are_refused() {
        let bad = [
            (rule(0, 1, TCP, 80, 0, VERDICT_ALLOW), "direction"),
            (rule(DIR_INGRESS, 1, TCP, 80, 0, 0), "verdict"),
            (rule(DIR_INGRESS, 1, 0, 80, 0, VERDICT_ALLOW), "needs a protocol"),
            (rule(DIR_INGRESS, 1, TCP, 0, 80, VERDICT_ALLOW), "no start port"),
            (rule(DIR_INGRESS, 1, TCP, 90, 80, VERDICT_ALLOW), "90-80"),
        ];
        for (r, text) in bad {
            let err = compile(1, &[rule(DIR_INGRESS, 1, TCP, 1, 0, VERDICT_ALLOW), r]).unwrap_err();
            assert!(err.to_string().starts_with("rule 1:"), "{err}");
            assert!(err.to_string().contains(text), "{err}");
        }
    }

    #[test]
    fn address_rules_compile_into_their_own_key_space() {
        let address = |peer, port, verdict| PolicyRule {
            by_address: true,
            ..rule(DIR_EGRESS, peer, TCP, port, 0, verdict)
        };
        let entries = compile(
            4,
            &[
                rule(DIR_EGRESS, CIDR_A, TCP, 0, 0, VERDICT_DENY),
                address(CIDR_A, 443, VERDICT_ALLOW),
            ],
        )
        .unwrap();
        // The identity deny for every port does not flatten the address
        // allow: they are different spaces (the datapath looks up both and
        // deny wins there).
        let keys: Vec<(PolicyKey, u8)> = entries.iter().map(|(e, v)| (e.key(), *v)).collect();
        assert_eq!(
            keys,
            [
                (PolicyKey::new(4, CIDR_A, DIR_EGRESS, TCP, 0, 0), VERDICT_DENY),
                (
                    PolicyKey::new(4, CIDR_A, DIR_EGRESS | POLICY_DIR_BY_ADDRESS, TCP, 443, 16),
                    VERDICT_ALLOW
                ),
            ]
        );
        for entry in entries.keys() {
            assert_eq!(PolicyEntry::from_lpm_key(&entry.lpm_key()), Some(*entry));
        }
        let err = compile(4, &[address(0, 80, VERDICT_ALLOW)]).unwrap_err();
        assert_eq!(err, PolicyRuleError::AddressWithoutPrefix { index: 0 });
    }

    #[test]
    fn entries_round_trip_through_map_keys() {
        let entries = compile(3, &[rule(DIR_INGRESS, 77, TCP, 1000, 3000, VERDICT_ALLOW)]).unwrap();
        for entry in entries.keys() {
            assert_eq!(PolicyEntry::from_lpm_key(&entry.lpm_key()), Some(*entry));
        }
        // Keys this module never writes are not entries.
        let mut key = PolicyKey::new(3, 77, DIR_INGRESS, TCP, 1024, 6);
        key.data.dport = 1025u16.to_be(); // bits beyond the prefix
        assert_eq!(PolicyEntry::from_key(&key), None);
        key.prefixlen = 97;
        assert_eq!(PolicyEntry::from_key(&key), None);
    }

    #[test]
    fn diff_orders_tightening_before_loosening() {
        let e = |port| PolicyEntry {
            endpoint_id: 1,
            direction: DIR_INGRESS,
            by_address: false,
            identity: 0,
            protocol: TCP,
            port,
            port_bits: 16,
        };
        let current = BTreeMap::from([(e(1), VERDICT_ALLOW), (e(2), VERDICT_DENY), (e(3), VERDICT_ALLOW)]);
        let desired = BTreeMap::from([(e(1), VERDICT_DENY), (e(3), VERDICT_ALLOW), (e(4), VERDICT_ALLOW)]);
        let d = diff(&current, &desired);
        assert_eq!(
            d.steps,
            vec![(e(1), Some(VERDICT_DENY)), (e(4), Some(VERDICT_ALLOW)), (e(2), None)],
            "e(3) is unchanged and not rewritten"
        );
        assert_eq!(d.phases().0, &d.steps[..1], "only tightening the first");
        let current = BTreeMap::from([(e(5), VERDICT_ALLOW)]);
        assert_eq!(diff(&current, &desired).steps[1], (e(5), None));
        assert!(diff(&desired, &desired).is_empty());
    }

    // ------------------------------------------------------------ property test

    /// xorshift64*: deterministic, no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn port(&mut self) -> u16 {
            self.next() as u16
        }
    }

    /// A simulated BPF LPM trie: longest prefix over the key *bytes* as the
    /// kernel compares them (byte by byte, most significant bit first).
    fn lpm_lookup(entries: &[(PolicyKey, u8)], lookup: &PolicyKey) -> Option<u8> {
        // The 12 data bytes in memory order, as one big-endian number: bit i
        // of the key (in the kernel's order) is bit 95 - i of this number.
        let bits = |k: &PolicyKey| -> u128 {
            let d = k.data;
            let mut b = [0u8; 16];
            b[4..8].copy_from_slice(&d.endpoint_id.to_ne_bytes());
            b[8..12].copy_from_slice(&d.identity.to_ne_bytes());
            b[12] = d.direction;
            b[13] = d.protocol;
            b[14..16].copy_from_slice(&d.dport.to_ne_bytes()); // already network order
            u128::from_be_bytes(b)
        };
        let want = bits(lookup);
        entries
            .iter()
            .filter(|(k, _)| {
                let unmatched = POLICY_PREFIX_FULL_BITS - k.prefixlen;
                k.prefixlen <= lookup.prefixlen && (bits(k) ^ want) >> unmatched == 0
            })
            .max_by_key(|(k, _)| k.prefixlen)
            .map(|(_, v)| *v)
    }

    /// What the datapath decides: four lookups by identity, two more in
    /// the address space when the peer address has a prefix, deny wins.
    fn datapath_verdict(
        entries: &[(PolicyKey, u8)],
        endpoint: u32,
        direction: u8,
        (peer, address): (u32, Option<u32>),
        protocol: u8,
        port: u16,
    ) -> Option<u8> {
        let by_address = address.map(|cidr| (cidr, direction | POLICY_DIR_BY_ADDRESS));
        let spaces = [(peer, direction), (0, direction)].into_iter().chain(by_address);
        let mut result = None;
        for (identity, direction) in spaces {
            for proto in [protocol, 0] {
                match lpm_lookup(entries, &PolicyKey::lookup(endpoint, identity, direction, proto, port)) {
                    Some(VERDICT_DENY) => return Some(VERDICT_DENY),
                    Some(v) => result = Some(v),
                    None => {}
                }
            }
        }
        result
    }

    /// What the rules say.
    fn rules_verdict(
        rules: &[PolicyRule],
        direction: u8,
        (peer, address): (u32, Option<u32>),
        protocol: u8,
        port: u16,
    ) -> Option<u8> {
        let matching = rules
            .iter()
            .filter(|r| r.matches(direction, peer, address, protocol, port));
        matching.map(|r| r.verdict).max() // VERDICT_DENY (2) > VERDICT_ALLOW (1)
    }

    const CIDR_A: u32 = 1 << 24;
    const CIDR_B: u32 = (1 << 24) + 1;

    fn random_rules(rng: &mut Rng, ports: &[u16]) -> Vec<PolicyRule> {
        let n = 1 + rng.below(7) as usize;
        (0..n)
            .map(|_| {
                let protocol = [0, TCP, TCP, UDP][rng.below(4) as usize];
                let (port, end_port) = if protocol == 0 {
                    (0, 0)
                } else {
                    match rng.below(5) {
                        0 => (0, 0),
                        1 | 2 => (ports[rng.below(ports.len() as u64) as usize], 0),
                        _ => {
                            let a = ports[rng.below(ports.len() as u64) as usize];
                            let b = ports[rng.below(ports.len() as u64) as usize];
                            if a == 0 || b == 0 {
                                (a.max(b).max(1), 0)
                            } else {
                                (a.min(b), a.max(b))
                            }
                        }
                    }
                };
                // A third of the rules match by address (ipBlock peers).
                let by_address = rng.below(3) == 0;
                let peer = if by_address {
                    [CIDR_A, CIDR_B][rng.below(2) as usize]
                } else {
                    [0, 300, 301][rng.below(3) as usize]
                };
                PolicyRule {
                    by_address,
                    ..rule(
                        [DIR_INGRESS, DIR_EGRESS][rng.below(2) as usize],
                        peer,
                        protocol,
                        port,
                        end_port,
                        [VERDICT_ALLOW, VERDICT_DENY][rng.below(2) as usize],
                    )
                }
            })
            .collect()
    }

    #[test]
    fn datapath_lookups_over_compiled_entries_equal_the_rules() {
        // A small universe of ports around block boundaries, where mistakes show.
        let ports: Vec<u16> = vec![
            1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 63, 64, 79, 80, 81, 255, 256, 1023, 1024, 1025, 4096, 32767, 32768,
            65534, 65535,
        ];
        let mut probe_ports = ports.clone();
        probe_ports.extend([0, 5, 9, 100, 1000, 2048, 40000]);
        let mut rng = Rng(0x0dd_ba11);
        let endpoint = 42;
        for case in 0..3000 {
            let rules = random_rules(&mut rng, &ports);
            let entries = compile(endpoint, &rules).unwrap_or_else(|e| panic!("case {case}: {e}: {rules:?}"));
            // Another endpoint's entries must not interfere.
            let mut keys: Vec<(PolicyKey, u8)> = entries.iter().map(|(e, v)| (e.key(), *v)).collect();
            keys.push((PolicyKey::new(endpoint + 1, 0, DIR_INGRESS, 0, 0, 0), VERDICT_DENY));
            for direction in [DIR_INGRESS, DIR_EGRESS] {
                for identity in [300, 301, 999, CIDR_A] {
                    for address in [None, Some(CIDR_A), Some(CIDR_B)] {
                        let peer = (identity, address);
                        for protocol in [TCP, UDP, 1] {
                            for &port in &probe_ports {
                                let got = datapath_verdict(&keys, endpoint, direction, peer, protocol, port);
                                let want = rules_verdict(&rules, direction, peer, protocol, port);
                                assert_eq!(
                                    got, want,
                                    "case {case}: dir {direction} peer {peer:?} proto {protocol} port {port}\n\
                                     rules: {rules:#?}\nentries: {entries:#?}"
                                );
                            }
                        }
                    }
                }
            }
            // Canonical: no entry repeats the verdict of its nearest enclosing entry.
            for (entry, verdict) in &entries {
                let nearest = entries
                    .iter()
                    .filter(|(o, _)| *o != entry && o.contains(entry))
                    .max_by_key(|(o, _)| o.port_bits);
                assert_ne!(
                    nearest.map(|(_, v)| v),
                    Some(verdict),
                    "case {case}: {entry:?} is redundant"
                );
            }
        }
    }

    /// Exhaustive over every port for a few hand-made rule sets with ranges.
    #[test]
    fn every_port_for_range_rules() {
        let sets = [
            vec![
                rule(DIR_INGRESS, 0, TCP, 1000, 2000, VERDICT_ALLOW),
                rule(DIR_INGRESS, 300, TCP, 1500, 1600, VERDICT_DENY),
            ],
            vec![
                rule(DIR_INGRESS, 300, TCP, 1, 65535, VERDICT_ALLOW),
                rule(DIR_INGRESS, 300, TCP, 22, 0, VERDICT_DENY),
                rule(DIR_INGRESS, 0, 0, 0, 0, VERDICT_ALLOW),
            ],
            vec![
                rule(DIR_INGRESS, 300, TCP, 8000, 8999, VERDICT_DENY),
                rule(DIR_INGRESS, 300, TCP, 8080, 0, VERDICT_ALLOW),
                rule(DIR_INGRESS, 300, TCP, 0, 0, VERDICT_ALLOW),
            ],
        ];
        for rules in sets {
            let entries = compile(1, &rules).unwrap();
            let keys: Vec<(PolicyKey, u8)> = entries.iter().map(|(e, v)| (e.key(), *v)).collect();
            for port in 0..=u16::MAX {
                for peer in [(300, None), (301, None)] {
                    assert_eq!(
                        datapath_verdict(&keys, 1, DIR_INGRESS, peer, TCP, port),
                        rules_verdict(&rules, DIR_INGRESS, peer, TCP, port),
                        "peer {peer:?} port {port}: {rules:?}"
                    );
                }
            }
        }
    }
}
